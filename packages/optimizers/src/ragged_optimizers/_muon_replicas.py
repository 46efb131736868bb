"""Muon under HSDP: each matrix orthogonalized once in the whole mesh, not once per replica.

Replicas hold the same shards, gradients (all-reduced over them) and momentum, so they would
run the same Newton-Schulz on the same matrices. Instead the owner plan spans the replicate x
shard ranks: a unit's owner is one (replica, shard rank) slot, chosen by the same LPT on
Newton-Schulz FLOPs over R x W slots, for every unit whose FLOPs outweigh the bytes its
update then costs over the replicate axis (`worth_sharing`: a price per unit from its shape
and one compute-to-link ratio); the cheaper units stay with every replica. Each replica
exchanges only its own units within its shard group (as without replicas), then one
all-gather over the replicate axis gives every rank its piece of every shared unit's update:
each rank receives the pieces the other replicas computed, (R - 1) / R of its pieces of
those updates in bfloat16, padded to the largest replica's share. The owner computes the
same batch from the same inputs, so the updates are bitwise those of each replica computing
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Replicate

from ragged_optimizers._compat import all_gather_single
from ragged_optimizers._layout import ParamLayout
from ragged_optimizers._muon_exchange import COMM_DTYPE, Unit, plan_units
from ragged_optimizers._owner_plan import ns_flops, plan_owners


@dataclass(frozen=True)
class Replicas:
    """The replicate axis of a sharded parameter's mesh (HSDP), as this rank sees it."""

    group: dist.ProcessGroup
    rank: int
    size: int


def replicas_of(layout: ParamLayout) -> Replicas | None:
    """The one replicate axis of size > 1 beside the shard axis, if every other axis is one.

    None for a 1-D mesh, or when another axis shards the parameter (tensor parallelism: its
    blocks are gathered over that axis instead).
    """
    mesh = layout.mesh
    if mesh is None or layout.axis is None or mesh.ndim < 2:
        return None
    others = [a for a in range(mesh.ndim) if a != layout.axis]
    if not all(isinstance(layout.placements[a], Replicate) for a in others):
        return None
    wide = [a for a in others if mesh.size(a) > 1]
    if len(wide) != 1:
        return None
    (axis,) = wide
    return Replicas(mesh.get_group(axis), mesh.get_local_rank(axis), mesh.size(axis))


def common_replicas(layouts: list[ParamLayout]) -> Replicas | None:
    """The replicate axis every one of these layouts has (the same group), else None.

    A shard group whose matrices mix replicated and tensor-parallel placements (a (dp, tp)
    mesh with some matrices Replicate over tp) keeps the per-replica exchange: tp ranks hold
    different blocks of the others.
    """
    found = [replicas_of(layout) for layout in layouts]
    first = found[0] if found else None
    if first is None or any(r is None or r.group is not first.group for r in found):
        return None
    return first


def worth_sharing(unit: Unit, ns_steps: int, flops_per_byte: float | None) -> bool:
    """Whether orthogonalizing `unit` once in the mesh beats once per replica.

    Once saves each replica but one the unit's Newton-Schulz FLOPs and costs each rank of
    those replicas its piece of the update over the replicate axis (2 bytes per element).
    Per rank, over R replicas of W ranks: (R - 1) / (R W) x FLOPs saved against
    (R - 1) / (R W) x 2 x numel bytes, so the choice depends on the unit's FLOPs per byte of
    update alone: share when it is at least `flops_per_byte` (the compute rate over the
    replicate axis' bandwidth per rank). None: always share.
    """
    if flops_per_byte is None:
        return True
    return ns_flops(unit.shape, ns_steps) >= flops_per_byte * 2 * unit.numel


def plan_over_replicas(
    units: list[Unit], num_replicas: int, ns_steps: int, flops_per_byte: float | None = None
) -> list[int | None]:
    """Each unit's replica (None: every replica), its owner on the shard axis set.

    Units not `worth_sharing` are planned first over the W shard ranks (each replica does
    them alike); the others over R x W slots by the same LPT, counting what each slot already
    has. Slot s is replica s // W, shard rank s % W; a slot holds its shard rank's pieces, so
    the plan prefers owners that hold much of a matrix, as on one replica.
    """
    if not units:
        return []
    world = units[0].layout.num_ranks
    slots = num_replicas * world
    shared = [worth_sharing(unit, ns_steps, flops_per_byte) for unit in units]
    alike = plan_units([u for u, s in zip(units, shared, strict=True) if not s], ns_steps)
    loads = [0] * world
    for unit in alike:
        loads[unit.owner] += ns_flops(unit.shape, ns_steps)
    once = [u for u, s in zip(units, shared, strict=True) if s]
    plan = plan_owners(
        [unit.name for unit in once],
        [unit.shape for unit in once],
        [[unit.piece(slot % world) for slot in range(slots)] for unit in once],
        slots,
        ns_steps,
        initial_loads=[loads[slot % world] for slot in range(slots)],
    )
    replica_of: list[int | None] = [None] * len(units)
    positions = [i for i, share in enumerate(shared) if share]
    for i, assignment in zip(positions, plan, strict=True):
        replica_of[i], units[i].owner = divmod(assignment.owner, world)
    return replica_of


def share_updates(
    units: list[Unit],
    replica_of: list[int],
    mine: dict[int, list[torch.Tensor]],
    replicas: Replicas,
) -> dict[int, list[torch.Tensor]]:
    """Every unit's pieces of its update on this rank, from the replica that computed it.

    `mine` holds this rank's pieces of its own replica's units (by unit id). One all-gather
    over the replicate axis, each replica's pieces in unit order, padded to the largest share.
    """
    me = units[0].layout.rank
    sizes = [0] * replicas.size
    for unit, replica in zip(units, replica_of, strict=True):
        sizes[replica] += unit.piece(me)
    width = max(sizes)
    own = [p for u, r in zip(units, replica_of, strict=True) if r == replicas.rank
           for p in mine[id(u)]]  # fmt: skip
    device = units[0].items[0].param.device  # NCCL: the collective's tensors on the GPU
    send = torch.zeros(width, dtype=COMM_DTYPE, device=device)
    if own:
        joined = torch.cat(own)
        send[: joined.numel()].copy_(joined)
    gathered = torch.empty(width * replicas.size, dtype=COMM_DTYPE, device=device)
    all_gather_single(gathered, send, group=replicas.group)
    offsets = [replica * width for replica in range(replicas.size)]
    out: dict[int, list[torch.Tensor]] = {}
    for unit, replica in zip(units, replica_of, strict=True):
        pieces = []
        for item in unit.items:
            lo, hi = item.layout.local_range
            pieces.append(gathered[offsets[replica] : offsets[replica] + hi - lo])
            offsets[replica] += hi - lo
        out[id(unit)] = pieces
    return out
