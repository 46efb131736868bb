"""Redistribution between DTensor specs where at least one mesh axis is RaggedShard.

RaggedShard on mesh axis i acts on the local block left by the placements of the other axes
(Replicate leaves the tensor whole, Shard(d) leaves this rank's torch.chunk of dim d).

Direct, exact paths when only axis i changes (see `_collectives` for the bytes):
  RaggedShard -> Replicate         gather_pieces           (N - n_r received)
  RaggedShard -> RaggedShard'      exchange_pieces         (only the overlaps that move)
  Shard(0) <-> RaggedShard         exchange_pieces         (a Shard(0) chunk is a flat range)
  Partial -> RaggedShard           reduce_scatter_pieces   (a reduce-scatter's volume)
  Replicate -> RaggedShard         local slice             (nothing)
Everything else goes in three steps: every RaggedShard axis of the source becomes Replicate
(gather), torch's own redistribute does the rest, then every RaggedShard axis of the target
is sliced locally. That is correct for any combination, but may move more than the minimum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ragged_placement._collectives import exchange_pieces, gather_pieces, reduce_scatter_pieces
from ragged_placement._compat import DTensorSpec
from ragged_placement._placement import RaggedShard, StridedRaggedShard, chunk_range

Original = Callable[..., torch.Tensor]


def check_placements(
    placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]
) -> None:
    """Validates RaggedShard use in a placement list against a tensor shape and mesh."""
    ragged = [
        (axis, p)
        for axis, p in enumerate(placements)
        if isinstance(p, RaggedShard | StridedRaggedShard)
    ]
    if len(ragged) > 1:
        raise ValueError(
            f"at most one RaggedShard per placement list, got {len(ragged)} in {tuple(placements)}"
        )
    for axis, p in ragged:
        if len(p.local_units) != mesh_shape[axis]:
            raise ValueError(
                f"{p!r} on mesh axis {axis} needs {mesh_shape[axis]} local_units (the axis size), "
                f"got {len(p.local_units)}"
            )
        if len(p.dims) > max(len(shape), 1):
            raise ValueError(f"{p!r} cuts dims {p.dims} but the tensor has shape {tuple(shape)}")
        if isinstance(p, StridedRaggedShard):
            splits = [a for a, q in enumerate(placements) if isinstance(q, Shard) and q.dim == 0]
            if len(splits) != 1 or mesh_shape[splits[0]] != p.split_factor:
                raise ValueError(
                    f"{p!r} needs exactly one other mesh axis with Shard(0) of size "
                    f"{p.split_factor}; got placements {tuple(placements)} on mesh "
                    f"{tuple(mesh_shape)}"
                )


def strided_axes(placements: Sequence[Placement]) -> tuple[int, StridedRaggedShard, int] | None:
    """(axis of the StridedRaggedShard, the placement, axis of its Shard(0)), if any."""
    for axis, p in enumerate(placements):
        if isinstance(p, StridedRaggedShard):
            split = next(a for a, q in enumerate(placements) if isinstance(q, Shard) and q.dim == 0)
            return axis, p, split
    return None


def unstrided(spec: DTensorSpec) -> DTensorSpec:
    """The spec with each rank (r, t) holding all of piece r: RaggedShard + Replicate."""
    found = strided_axes(spec.placements)
    assert found is not None
    axis, p, split = found
    placements = list(spec.placements)
    placements[axis], placements[split] = p.ragged, Replicate()
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _strided_parts(spec: DTensorSpec) -> tuple[list[tuple[int, int]], int, int]:
    """Every part's (start, end) within this rank's piece, in elements; its part; piece numel."""
    found = strided_axes(spec.placements)
    assert found is not None
    axis, p, split = found
    mesh, shape = spec.mesh, spec.shape
    row = math.prod(shape[1:])
    rank, num_ranks = mesh.get_local_rank(axis), mesh.size(axis)
    first, end = p.piece_rows(shape, num_ranks)[rank]
    parts = []
    for part in range(p.split_factor):
        lo, hi = p.chunk_rows(shape, num_ranks, rank, part)
        parts.append(((lo - first) * row, (hi - first) * row))
    return parts, mesh.get_local_rank(split), (end - first) * row


def strided_chunk(spec: DTensorSpec) -> tuple[int, int, int]:
    """(start, end) of this rank's chunk within its piece, in elements, and the piece numel."""
    parts, part, numel = _strided_parts(spec)
    return (*parts[part], numel)


def _unstride(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    found = strided_axes(spec.placements)
    assert found is not None
    parts, _, numel = _strided_parts(spec)
    return gather_pieces(local, parts, spec.mesh.get_group(found[2]), numel)


def block_shape(spec: DTensorSpec, skip_axis: int) -> list[int]:
    """Shape of this rank's block after every Shard placement except the one on `skip_axis`."""
    shape = list(spec.shape)
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None, "the rank must be part of the mesh"
    for axis, p in enumerate(spec.placements):
        if axis != skip_axis and isinstance(p, Shard):
            lo, hi = chunk_range(shape[p.dim], spec.mesh.size(axis), coordinate[axis])
            shape[p.dim] = hi - lo
    return shape


def reference_block_shape(spec: DTensorSpec, skip_axis: int) -> list[int]:
    """The largest block the other axes' Shard placements leave: that of their first ranks.

    torch's Shard(d) cuts as torch.chunk does, so with uneven splits the first rank of an
    axis holds the most; the RaggedShard on `skip_axis` counts its units in this block, the
    same on every rank (`RaggedShard.flat_ranges`'s reference).
    """
    shape = list(spec.shape)
    for axis, p in enumerate(spec.placements):
        if axis != skip_axis and isinstance(p, Shard):
            lo, hi = chunk_range(shape[p.dim], spec.mesh.size(axis), 0)
            shape[p.dim] = hi - lo
    return shape


def ragged_ranges(spec: DTensorSpec, axis: int) -> tuple[tuple[int, int], ...]:
    """Every rank's flat range, along `axis` (a RaggedShard), of this rank's block."""
    placement = spec.placements[axis]
    assert isinstance(placement, RaggedShard)
    block, reference = block_shape(spec, axis), reference_block_shape(spec, axis)
    return placement.flat_ranges(block, spec.mesh.size(axis), reference)


def _ranges_as(spec: DTensorSpec, axis: int, placement: RaggedShard) -> tuple[tuple[int, int], ...]:
    """`ragged_ranges` with `placement` in place of `spec`'s on `axis` (a target's ranges)."""
    placements = list(spec.placements)
    placements[axis] = placement
    return ragged_ranges(
        DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta), axis
    )


def _shard0_ranges(shape: Sequence[int], parts: int) -> tuple[tuple[int, int], ...]:
    row = math.prod(shape[1:])
    rows = (chunk_range(shape[0], parts, i) for i in range(parts))
    return tuple((lo * row, hi * row) for lo, hi in rows)


def _single_axis(
    local: torch.Tensor,
    spec: DTensorSpec,
    axis: int,
    src: Placement,
    dst: Placement,
    async_op: bool,
) -> torch.Tensor | None:
    """Direct path for a change on one mesh axis, or None when there is none."""
    mesh = spec.mesh
    group = mesh.get_group(axis)
    parts = mesh.size(axis)
    shape = block_shape(spec, axis)
    numel = math.prod(shape)
    if isinstance(src, RaggedShard):
        old = ragged_ranges(spec, axis)
        if isinstance(dst, Replicate):
            return gather_pieces(local, old, group, numel, async_op=async_op).view(shape)
        if isinstance(dst, RaggedShard):
            new = _ranges_as(spec, axis, dst)
            return exchange_pieces(local, old, new, group, async_op=async_op)
        if isinstance(dst, Shard) and dst.dim == 0 and shape:
            new = _shard0_ranges(shape, parts)
            out = exchange_pieces(local, old, new, group, async_op=async_op)
            return out.view(-1, *shape[1:])
        return None
    assert isinstance(dst, RaggedShard)
    new = _ranges_as(spec, axis, dst)
    lo, hi = new[mesh.get_local_rank(axis)]
    if isinstance(src, Replicate):
        # clone: the piece must not keep the whole replicated block alive.
        return local.reshape(-1)[lo:hi].clone()
    if isinstance(src, Shard) and src.dim == 0 and shape:
        old = _shard0_ranges(shape, parts)
        return exchange_pieces(local, old, new, group, async_op=async_op)
    if isinstance(src, Partial):
        return reduce_scatter_pieces(local, new, group, src.reduce_op)
    return None


def redistribute_ragged(
    local: torch.Tensor,
    current: DTensorSpec,
    target: DTensorSpec,
    original: Original,
    async_op: bool = False,
) -> torch.Tensor:
    """Moves `local` from spec `current` to spec `target` (see the module docstring).

    With `async_op`, the one-collective paths (all-gather of equal pieces, all-to-all
    exchanges) return a tensor that completes lazily, as torch's own async redistribute does.
    """
    if current.mesh != target.mesh:
        raise ValueError(f"cannot redistribute across meshes ({current.mesh} -> {target.mesh})")
    mesh_shape = tuple(current.mesh.shape)
    check_placements(current.placements, current.shape, mesh_shape)
    check_placements(target.placements, target.shape, mesh_shape)
    if current.placements == target.placements:
        return local
    # A StridedRaggedShard goes through its unstrided form: gather the chunks of each piece
    # (within the Shard(0) axis) first, and cut the target's chunk locally at the end.
    if strided_axes(current.placements) is not None:
        local, current = _unstride(local, current), unstrided(current)
    if strided_axes(target.placements) is not None:
        piece = _redistribute_plain(local, current, unstrided(target), original, False)
        lo, hi, _ = strided_chunk(target)
        return piece.reshape(-1)[lo:hi].clone()
    return _redistribute_plain(local, current, target, original, async_op)


def _redistribute_plain(
    local: torch.Tensor,
    current: DTensorSpec,
    target: DTensorSpec,
    original: Original,
    async_op: bool,
) -> torch.Tensor:
    # Both specs were validated by redistribute_ragged (unstriding keeps them valid).
    if current.placements == target.placements:
        return local
    changed = [
        a
        for a, (s, d) in enumerate(zip(current.placements, target.placements, strict=True))
        if s != d
    ]
    others_plain = all(
        not isinstance(p, RaggedShard | Partial)
        for a, p in enumerate(current.placements)
        if a not in changed
    )
    if len(changed) == 1 and others_plain:
        axis = changed[0]
        src, dst = current.placements[axis], target.placements[axis]
        if isinstance(src, RaggedShard) or isinstance(dst, RaggedShard):
            out = _single_axis(local, current, axis, src, dst, async_op)
            if out is not None:
                return out

    # General path: gather ragged axes, let torch move the rest, slice ragged axes again.
    plain_src = tuple(Replicate() if isinstance(p, RaggedShard) else p for p in current.placements)
    for axis, p in enumerate(current.placements):
        if isinstance(p, RaggedShard):
            spec = DTensorSpec(current.mesh, current.placements, tensor_meta=current.tensor_meta)
            shape = block_shape(spec, axis)
            local = gather_pieces(
                local, ragged_ranges(spec, axis), current.mesh.get_group(axis), math.prod(shape)
            ).view(shape)
    plain_dst = tuple(Replicate() if isinstance(p, RaggedShard) else p for p in target.placements)
    src_spec = DTensorSpec(current.mesh, plain_src, tensor_meta=current.tensor_meta)
    dst_spec = DTensorSpec(target.mesh, plain_dst, tensor_meta=target.tensor_meta)
    if plain_src != plain_dst:
        local = original(local, src_spec, dst_spec)
    for axis, p in enumerate(target.placements):
        if isinstance(p, RaggedShard):
            lo, hi = ragged_ranges(target, axis)[current.mesh.get_local_rank(axis)]
            local = local.reshape(-1)[lo:hi].clone()
    return local
