"""What the DBuffer case modules share: the test tensors (uneven sizes, an empty one)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_tensors(world: int, dtype: str, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (17, 8), "b1": (8,), "w2": (3 * world + 1, 5), "empty": (0, 4), "s": (1,)}
    return [(n, torch.randn(s, generator=gen).to(DTYPES[dtype])) for n, s in shapes.items()]
