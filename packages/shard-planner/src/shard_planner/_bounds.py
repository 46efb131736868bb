"""Lower bound on the shard size of any valid layout, and the lcm grids the search walks."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shard_planner._spec import TensorSpec, check_count


def ceil_to(value: int, multiple: int) -> int:
    """Rounds `value` up to a multiple of `multiple` (> 0)."""
    return -(-value // multiple) * multiple


def lower_bound(specs: Sequence[TensorSpec], world_size: int, *, align: int = 1) -> int:
    """The smallest shard size S that no valid layout can beat.

    S is the smallest multiple of `align` that is (a) at least ceil(sum numel / world_size),
    (b) at least every tensor's block (a tensor smaller than its block is one block), and
    (c) divisible by the block of every tensor with numel >= 2 * S: such a tensor contains two
    rank boundaries S apart, or exactly one at offset S from its start, and both must be block
    boundaries.

    Args:
        specs: The group's tensors.
        world_size: Number of ranks, >= 1.
        align: S must be a multiple of this many elements, >= 1.

    Returns:
        The bound, in elements (0 for a group without elements).

    Example:
        >>> from shard_planner import TensorSpec
        >>> lower_bound([TensorSpec("w", 1000, block=300)], world_size=4)
        300
    """
    world_size = check_count("lower_bound world_size", world_size, 1)
    align = check_count("lower_bound align", align, 1)
    total = sum(s.numel for s in specs)
    if total == 0:
        return 0
    base = ceil_to(max(-(-total // world_size), max(s.atom for s in specs)), align)
    # (c) depends on S itself. Walk the tensors from the largest down: with the j largest in
    # the "contains a whole shard" set, S lies in (numel_{j+1} / 2, numel_j / 2] and must be a
    # multiple of lcm(align, blocks of those j).
    by_size = sorted(specs, key=lambda s: s.numel, reverse=True)
    best = None
    grid = align
    for j in range(len(by_size) + 1):
        if j:
            grid = math.lcm(grid, by_size[j - 1].atom)
        floor = by_size[j].numel // 2 + 1 if j < len(by_size) else 0
        candidate = ceil_to(max(base, floor), grid)
        if (j == 0 or 2 * candidate <= by_size[j - 1].numel) and (best is None or candidate < best):
            best = candidate
        if j and 2 * base > by_size[j - 1].numel:
            break  # smaller tensors can never hold 2 * S >= 2 * base elements
    assert best is not None  # j == 0 always yields a candidate
    return best


def search_grids(specs: Sequence[TensorSpec], align: int) -> list[int]:
    """The lcm grids for S: lcm(align, blocks of the j largest tensors) for every j, deduped.

    The tensors that may contain a whole shard are unknown up front; a shard inside tensor t
    forces S to be a multiple of t's block, and the largest tensors are the ones that can hold
    a shard, so the candidate sets are prefixes of the tensors sorted by size.
    """
    grids = [align]
    for spec in sorted(specs, key=lambda s: s.numel, reverse=True):
        if spec.numel:
            grid = math.lcm(grids[-1], spec.atom)
            if grid != grids[-1]:
                grids.append(grid)
    return grids
