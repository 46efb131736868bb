"""Checks and an exact solver for planner tests, written independently of the planner.

`violations` walks every rank boundary (not every tensor, as `Layout.validate` does) and finds
the tensor under it by bisection. `exact_shard_size` solves tiny instances exactly by dynamic
programming over subsets of tensors, scanning offsets one by one.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from shard_planner import TensorSpec


def violations(
    specs: Sequence[TensorSpec], starts: Sequence[int], shard_size: int, world_size: int, align: int
) -> list[str]:
    """Every broken constraint of a layout, as readable strings (empty list: valid)."""
    problems = []
    total = sum(s.numel for s in specs)
    if shard_size % align:
        problems.append(f"shard size {shard_size} not a multiple of align {align}")
    if world_size * shard_size < total:
        problems.append(f"{world_size} x {shard_size} cannot hold {total} elements")
    intervals = sorted(
        (
            (start, start + spec.numel, spec)
            for spec, start in zip(specs, starts, strict=True)
            if spec.numel
        ),
        key=lambda iv: (iv[0], iv[1]),
    )
    for (s0, e0, a), (s1, _, b) in itertools.pairwise(intervals):
        if s1 < e0:
            problems.append(f"{a.name} [{s0}, {e0}) overlaps {b.name} starting at {s1}")
    for spec, start in zip(specs, starts, strict=True):
        if start < 0 or start + spec.numel > world_size * shard_size:
            problems.append(f"{spec.name} at {start} lies outside the buffer")
    begins = [iv[0] for iv in intervals]
    for k in range(1, world_size):
        boundary = k * shard_size
        i = bisect.bisect_right(begins, boundary) - 1
        if i < 0:
            continue
        start, end, spec = intervals[i]
        if start < boundary < end:
            block = min(spec.block, spec.numel)
            if (boundary - start) % block:
                problems.append(
                    f"boundary {boundary} cuts a block of {spec.name} starting at {start}"
                )
    return problems


def _valid_at(start: int, numel: int, block: int, shard_size: int) -> bool:
    block = min(block, numel)
    boundary = (start // shard_size + 1) * shard_size
    while boundary < start + numel:
        if (boundary - start) % block:
            return False
        boundary += shard_size
    return True


def _fits(specs: Sequence[TensorSpec], shard_size: int, world_size: int) -> bool:
    # min_cursor[mask]: the smallest end of a valid packing of the tensors in mask. Any packing
    # with a larger end can be replaced by this one: a tensor's valid starts do not depend on
    # what lies before it.
    capacity = shard_size * world_size
    n = len(specs)
    min_cursor = {0: 0}
    for mask in range(1 << n):
        cursor = min_cursor.get(mask)
        if cursor is None:
            continue
        for i in range(n):
            if mask >> i & 1:
                continue
            spec = specs[i]
            start = cursor
            while start + spec.numel <= capacity and not _valid_at(
                start, spec.numel, spec.block, shard_size
            ):
                start += 1
            end = start + spec.numel
            if end <= capacity:
                nxt = mask | 1 << i
                if end < min_cursor.get(nxt, capacity + 1):
                    min_cursor[nxt] = end
    return (1 << n) - 1 in min_cursor


def exact_shard_size(specs: Sequence[TensorSpec], world_size: int, align: int) -> int:
    """The optimal shard size of a tiny instance (every order, every offset)."""
    total = sum(s.numel for s in specs)
    if total == 0:
        return 0
    size = align
    while not _fits(specs, size, world_size):
        size += align
    return size
