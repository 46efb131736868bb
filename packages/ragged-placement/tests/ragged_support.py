"""What the RaggedShard case modules share: the mesh, reference tensors, unit ranges.

Each check builds the full tensor from a fixed seed on every rank (`reference_tensor`),
applies the distributed operation, and compares with the single-process result on it.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def reference_tensor(shape: tuple[int, ...], dtype: str = "fp32", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(DTYPES[dtype])


def unit_ranges(units: tuple[int, ...], numel: int) -> list[tuple[int, int]]:
    unit = numel // sum(units)
    bounds = [0]
    for u in units:
        bounds.append(bounds[-1] + u * unit)
    return list(itertools.pairwise(bounds))


WORLD_SIZES = [1, 2, 3, 4]  # 3: not a power of two
# Balanced, uneven with an empty rank, and one-hot units for each world size.
UNITS = {
    1: [(1,), (3,)],
    2: [(1, 1), (3, 1), (0, 2)],
    3: [(1, 1, 1), (2, 0, 3), (0, 1, 0)],
    4: [(1, 1, 1, 1), (1, 0, 4, 2), (0, 0, 1, 0)],
}
