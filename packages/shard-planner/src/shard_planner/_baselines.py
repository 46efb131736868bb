"""Padding of the two classic sharding schemes, computed exactly from shapes.

These are the baselines the planner is compared with (`shard-planner compare`):
- FSDP2 (`fully_shard`): every parameter is its own `Shard(0)` DTensor, cut like
  `torch.chunk` on dim 0, and each rank's piece is padded to ceil(dim0 / m) rows, so a
  parameter costs m * ceil(dim0 / m) rows in the all-gather buffer. Blocks are ignored.
- FSDP2 keeping blocks whole (what it would take: FSDP2 has no such option): each tensor
  padded to a multiple of W blocks, so that its even `Shard(0)` chunks hold whole blocks.
- FSDP1 / ZeRO flat sharding: the group is concatenated into one flat buffer padded to an equal
  (aligned) chunk per rank. It pads least but cuts blocks and rows anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shard_planner._bounds import ceil_to
from shard_planner._spec import TensorSpec, check_count, check_world_size


def fsdp2_padding(specs: Sequence[TensorSpec], world_size: int) -> int:
    """Padding elements FSDP2's per-parameter `Shard(0)` adds to one group.

    Args:
        specs: The group's tensors; each must carry its `shape` (see `TensorSpec.from_shape`).
        world_size: Number of ranks, >= 1.

    Returns:
        sum over tensors of m * ceil(dim0 / m) * row - numel (0-D tensors count as one row).

    Example:
        >>> fsdp2_padding([TensorSpec.from_shape("w", (10, 4))], world_size=4)
        8
    """
    check_world_size("world_size", world_size)
    padding = 0
    for spec in specs:
        if spec.shape is None:
            raise ValueError(f"fsdp2_padding needs the shape of tensor {spec.name!r}")
        rows = spec.shape[0] if spec.shape else 1
        row = math.prod(spec.shape[1:])
        padding += world_size * -(-rows // world_size) * row - spec.numel
    return padding


def fsdp2_whole_block_padding(specs: Sequence[TensorSpec], world_size: int) -> int:
    """Padding FSDP2's per-parameter `Shard(0)` would need to keep every block whole.

    Each tensor's rows are padded to a multiple of `block rows x world_size`, so that every
    rank's even chunk is whole blocks (the like-for-like baseline of our block-aware layout;
    with one-row blocks it is `fsdp2_padding`).

    Args:
        specs: The group's tensors (their `atom` is one block's elements).
        world_size: Number of ranks, >= 1.

    Returns:
        sum over tensors of m * ceil(blocks / m) * block - numel.

    Example:
        >>> fsdp2_whole_block_padding([TensorSpec("w", 40, block=8)], world_size=4)
        24
    """
    check_world_size("world_size", world_size)
    padding = 0
    for spec in specs:
        blocks = -(-spec.numel // spec.atom)
        padding += world_size * -(-blocks // world_size) * spec.atom - spec.numel
    return padding


def flat_padding(specs: Sequence[TensorSpec], world_size: int, *, align: int = 1) -> int:
    """Padding elements of FSDP1-style flat sharding: one buffer, equal aligned chunks.

    Example:
        >>> flat_padding([TensorSpec("a", 10), TensorSpec("b", 3)], world_size=4)
        3
    """
    check_world_size("world_size", world_size)
    check_count("align", align, 1)
    total = sum(s.numel for s in specs)
    return world_size * ceil_to(-(-total // world_size), align) - total
