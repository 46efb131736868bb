"""torch.distributed.checkpoint (DCP) for RaggedShard DTensors.

DCP stores a tensor as N-D boxes ("chunks") and reshards on load by overlapping them. A
RaggedShard piece is a flat range of the row-major block, so it is written as the few boxes
that tile that range exactly (at most two partial rows per cut dim, plus one box of whole
rows), each a view of the local piece: every rank writes only its own elements, no data moves
between ranks, and loading copies the overlaps straight into the local piece. Any other
placement on the destination (other units, world size, Shard, Replicate) loads through DCP's
usual overlap logic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Shard

from ragged_placement._compat import spec_of
from ragged_placement._placement import RaggedShard, chunk_range
from ragged_placement._redistribute import block_shape, ragged_ranges, strided_axes
from ragged_placement._views import flat_range

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_range_boxes(lo: int, hi: int, shape: Sequence[int]) -> list[Box]:
    """Boxes (offsets, sizes) tiling the flat range [lo, hi) of a row-major `shape`, in order.

    Example:
        >>> flat_range_boxes(2, 9, (3, 4))
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, first_rest = divmod(lo, inner)
    last, last_rest = divmod(hi, inner)
    rest_shape = tuple(shape[1:])

    def rows(index: int, start: int, end: int) -> list[Box]:
        return [((index, *o), (1, *s)) for o, s in flat_range_boxes(start, end, rest_shape)]

    if first == last:  # inside one row of dim 0
        return rows(first, first_rest, last_rest)
    boxes: list[Box] = []
    if first_rest:
        boxes += rows(first, first_rest, inner)
        first += 1
    if last > first:
        boxes.append(((first, *(0,) * len(rest_shape)), (last - first, *rest_shape)))
    if last_rest:
        boxes += rows(last, 0, last_rest)
    return boxes


def local_boxes(dt: DTensor) -> list[tuple[Box, torch.Tensor]]:
    """This rank's boxes in global coordinates, each with the view of the local piece it is."""
    spec = spec_of(dt)
    if any(isinstance(p, Partial) for p in spec.placements):
        raise ValueError(
            "a DTensor with a Partial placement cannot be checkpointed; reduce it first"
        )
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    if strided_axes(spec.placements) is not None:
        # A chunk of a piece of the whole tensor: a flat range of the global tensor.
        block, offset = list(spec.shape), [0] * len(spec.shape)
        lo, hi = flat_range(dt)
    else:
        axis = next(a for a, p in enumerate(spec.placements) if isinstance(p, RaggedShard))
        placement = spec.placements[axis]
        assert isinstance(placement, RaggedShard)
        block = block_shape(spec, axis)
        # Global offset of this rank's block: the Shard placements of the other axes.
        offset = [0] * len(spec.shape)
        for other, p in enumerate(spec.placements):
            if other != axis and isinstance(p, Shard):
                size, parts = spec.shape[p.dim], mesh.size(other)
                offset[p.dim] += chunk_range(size, parts, coordinate[other])[0]
        lo, hi = ragged_ranges(spec, axis)[coordinate[axis]]
    local = dt.to_local()
    out = []
    cursor = 0
    for box_offset, sizes in flat_range_boxes(lo, hi, block):
        numel = math.prod(sizes)
        view = local[cursor : cursor + numel].view(sizes)
        cursor += numel
        out.append(((tuple(o + b for o, b in zip(offset, box_offset, strict=True)), sizes), view))
    return out


def write_items(dt: DTensor, fqn: str) -> list[WriteItem]:
    """DCP write items for a RaggedShard DTensor: one per box."""
    properties = TensorProperties.create_from_tensor(dt.to_local())
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=properties,
                size=dt.size(),
            ),
        )
        for (offsets, sizes), _ in local_boxes(dt)
    ]


def chunk_list(dt: DTensor) -> list[ChunkStorageMetadata]:
    """DCP chunks a RaggedShard DTensor holds on this rank."""
    return [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
        for (o, s), _ in local_boxes(dt)
    ]


def tensor_shard(dt: DTensor, index: MetadataIndex) -> torch.Tensor:
    """The local view DCP reads into or writes from for the chunk at `index.offset`."""
    for (offsets, _), view in local_boxes(dt):
        if index.offset is not None and torch.Size(offsets) == index.offset:
            return view
    raise ValueError(f"no local chunk of {index.fqn!r} at offset {index.offset} on this rank")
