"""Muon's owner exchange: matrices in units, their owners, buckets, and the all-to-alls.

Everything here is a function of shapes, order and the owner plan: the same on every rank,
so no rank asks another what to send. Units are same-shape matrices orthogonalized as one
batch; each bucket of units goes to its owners in one uneven all-to-all (pieces in bfloat16)
and comes back in another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ragged_optimizers._layout import ParamLayout
from ragged_optimizers._owner_plan import plan_owners
from ragged_optimizers._per_head import head_shape

COMM_DTYPE = torch.bfloat16


def matrix_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The matrix (or stack) Newton-Schulz sees: 2-D as is, 3-D a stack, 4-D (out, rest).

    Example:
        >>> matrix_shape((64, 3, 3, 3))
        (64, 27)
    """
    if len(shape) in (2, 3):
        return tuple(shape)
    if len(shape) == 4:
        return (shape[0], math.prod(shape[1:]))
    raise ValueError(f"Muon takes 2-D, 3-D or 4-D parameters, got shape {tuple(shape)}")


@dataclass
class Item:
    """One sharded Muon matrix on this step."""

    param: torch.Tensor
    name: str
    layout: ParamLayout
    update: torch.Tensor  # this rank's piece of the momentum-updated matrix, in bfloat16
    group: dict[str, Any]


@dataclass
class Unit:
    """Matrices orthogonalized together: one, or a stack of same-shape 2-D matrices."""

    items: list[Item]
    owner: int = 0
    tp_rank: int | None = None  # under tensor parallelism, the tp rank that computes it

    @property
    def layout(self) -> ParamLayout:
        return self.items[0].layout

    @property
    def group(self) -> dict[str, Any]:
        return self.items[0].group

    @property
    def name(self) -> str:
        extra = len(self.items) - 1
        return self.items[0].name + (f" (+{extra} of its shape)" if extra else "")

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The matrix, or (count, rows, cols) for a stack of the unit's matrices."""
        shape = matrix_shape(self.layout.full_shape)
        return shape if len(self.items) == 1 else (len(self.items), *shape)

    @property
    def heads(self) -> tuple[int | None, int]:
        """The group's (num_heads, heads_dim): (None, 0) orthogonalizes whole matrices."""
        return self.group.get("num_heads"), self.group.get("heads_dim", 0)

    @property
    def shape(self) -> tuple[int, ...]:
        """What Newton-Schulz sees: `stack_shape`, split into heads in per-head groups."""
        return head_shape(self.stack_shape, *self.heads)

    @property
    def numel(self) -> int:
        return sum(item.layout.numel for item in self.items)

    def piece(self, rank: int) -> int:
        return sum(hi - lo for lo, hi in (item.layout.ranges[rank] for item in self.items))


def make_units(items: list[Item], batch_numel: int, num_owners: int = 1) -> list[Unit]:
    """Same-shape 2-D matrices of one group in order, up to `batch_numel` elements per unit.

    A matrix of a 3-D stack, or one that cannot share `batch_numel` with another of its
    shape, is a unit alone. With `num_owners` > 1, n matrices of one shape are batched only
    as far as the owners stay evenly loaded: at least `num_owners` units of them when
    n >= num_owners (8 equal matrices over 4 owners: 4 units of 2, not 1 of 8). Built from
    shapes, order and the owner count alone: the same units on every rank.
    """
    keys: list[tuple[Any, ...] | None] = []
    counts: dict[tuple[Any, ...], int] = {}
    for item in items:
        layout = item.layout
        shape = matrix_shape(layout.full_shape)
        if len(shape) != 2 or 2 * math.prod(shape) > batch_numel:
            keys.append(None)
            continue
        # Batched matrices must also be split alike over any tensor-parallel axes.
        others = tuple(p for axis, p in enumerate(layout.placements) if axis != layout.axis)
        key: tuple[Any, ...] = (id(item.group), shape, layout.shape, others, item.param.dtype)
        keys.append(key)
        counts[key] = counts.get(key, 0) + 1
    units: list[Unit] = []
    open_units: dict[tuple[Any, ...], Unit] = {}
    for item, found in zip(items, keys, strict=True):
        if found is None:
            units.append(Unit([item]))
            continue
        numel = math.prod(found[1])
        most = min(batch_numel // numel, _balanced_batch(counts[found], num_owners))
        unit = open_units.get(found)
        if unit is None or len(unit.items) + 1 > most:
            unit = open_units[found] = Unit([])
            units.append(unit)
        unit.items.append(item)
    return units


def _balanced_batch(count: int, num_owners: int) -> int:
    """The most matrices of one shape per unit that still gives every owner one, if it can.

    Example: 8 over 3 owners -> 3 (units of 3, 3, 2); 5 over 4 -> 1 (2 would make 3 units).
    """
    if num_owners <= 1 or count <= 1:
        return max(count, 1)
    size = -(-count // num_owners)
    if -(-count // size) < num_owners:
        size = max(1, count // num_owners)
    return size


def tp_size(unit: Unit) -> int:
    """The tensor-parallel axis' size when one splits the unit's matrices, else 1."""
    layout = unit.layout
    split = layout.tensor_parallel()
    return 1 if split is None or layout.mesh is None else layout.mesh.size(split[0])


def plan_units(units: list[Unit], ns_steps: int, num_tp: int = 1) -> list[Unit]:
    """Sets each unit's owner (LPT over the units), the same on every rank.

    With `num_tp` > 1 (tensor parallelism, one tp rank computing each unit) the slots are
    dp owner x tp rank: slot // num_tp is the dp owner, slot % num_tp the tp rank that
    gathers the unit's blocks and orthogonalizes it, so the FLOPs even out over both axes.
    """
    if units:
        world = units[0].layout.num_ranks
        slots = world * num_tp
        plan = plan_owners(
            [unit.name for unit in units],
            [unit.shape for unit in units],
            [[unit.piece(slot // num_tp) for slot in range(slots)] for unit in units],
            slots,
            ns_steps,
        )
        for unit, assignment in zip(units, plan, strict=True):
            unit.owner, tp_rank = divmod(assignment.owner, num_tp)
            unit.tp_rank = tp_rank if num_tp > 1 else None
    return units


def agree(items: list[Item]) -> list[Item]:
    """The sharded matrices with a gradient, after checking every rank agrees (no hang)."""
    kept = []
    for members in by_process_group(items):
        flags = torch.tensor([float(m.param.grad is not None) for m in members])
        group = members[0].layout.group
        dist.all_reduce(flags, group=group)
        world = members[0].layout.num_ranks
        for item, count in zip(members, flags.tolist(), strict=True):
            if count not in (0.0, float(world)):
                raise ValueError(
                    f"Muon: {item.name} has a gradient on {int(count)} of {world} ranks; a "
                    f"sharded matrix needs its gradient on every rank or on none"
                )
            if count:
                kept.append(item)
    return kept


def by_process_group(items: list[Item]) -> list[list[Item]]:
    groups: dict[int, list[Item]] = {}
    for item in items:
        groups.setdefault(id(item.layout.group), []).append(item)
    return list(groups.values())


def buckets(units: list[Unit], bucket_bytes: int) -> list[list[Unit]]:
    buckets: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        if buckets[-1] and size + unit.numel * 2 > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(unit)
        size += unit.numel * 2
    return buckets


def send_to_owners(
    bucket: list[Unit], me: int, world: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, Any]:
    # Input in destination order, output in source order; pieces keep the bucket's order.
    send = [
        item.update for dst in range(world) for u in bucket if u.owner == dst for item in u.items
    ]
    send_splits = [sum(u.piece(me) for u in bucket if u.owner == dst) for dst in range(world)]
    recv_splits = [sum(u.piece(src) for u in bucket if u.owner == me) for src in range(world)]
    return _all_to_all(send, send_splits, recv_splits, group)


def assemble(
    bucket: list[Unit], received: torch.Tensor, me: int, world: int
) -> list[tuple[Unit, list[torch.Tensor]]]:
    owned = [unit for unit in bucket if unit.owner == me]
    if len(owned) == 1 and len(owned[0].items) == 1:
        return [(owned[0], [received])]  # the pieces arrived in rank order: the whole matrix
    fulls = [[torch.empty(i.layout.numel, dtype=COMM_DTYPE) for i in u.items] for u in owned]
    offset = 0
    for src in range(world):
        for unit, unit_fulls in zip(owned, fulls, strict=True):
            for item, full in zip(unit.items, unit_fulls, strict=True):
                lo, hi = item.layout.ranges[src]
                full[lo:hi].copy_(received[offset : offset + hi - lo])
                offset += hi - lo
    return list(zip(owned, fulls, strict=True))


def send_back(
    bucket: list[Unit],
    updates: dict[int, list[torch.Tensor]],
    me: int,
    world: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, Any]:
    owned = [unit for unit in bucket if unit.owner == me]
    send = []
    for dst in range(world):
        for unit in owned:
            for item, update in zip(unit.items, updates[id(unit)], strict=True):
                lo, hi = item.layout.ranges[dst]
                send.append(update[lo:hi])
    send_splits = [sum(u.piece(dst) for u in owned) for dst in range(world)]
    recv_splits = [sum(u.piece(me) for u in bucket if u.owner == src) for src in range(world)]
    return _all_to_all(send, send_splits, recv_splits, group)


def _all_to_all(
    pieces: list[torch.Tensor],
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, Any]:
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=COMM_DTYPE)
    received = torch.empty(sum(recv_splits), dtype=COMM_DTYPE, device=send.device)
    work = dist.all_to_all_single(
        received,
        send,
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=group,
        async_op=True,
    )
    return received, work
