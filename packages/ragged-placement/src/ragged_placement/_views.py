"""Views of a RaggedShard DTensor's local piece."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ragged_placement._compat import spec_of
from ragged_placement._placement import RaggedShard, StridedRaggedShard
from ragged_placement._redistribute import block_shape, strided_axes


def _ragged_axis(dt: DTensor) -> tuple[int, RaggedShard | StridedRaggedShard]:
    if not isinstance(dt, DTensor):
        raise TypeError(f"expected a DTensor, got {type(dt).__name__}")
    for axis, p in enumerate(dt.placements):
        if isinstance(p, RaggedShard | StridedRaggedShard):
            return axis, p
    raise ValueError(f"expected a DTensor with a RaggedShard placement, got {dt.placements}")


def flat_range(dt: DTensor) -> tuple[int, int]:
    """This rank's [start, end) in the flattened tensor.

    With other placements on the mesh (HSDP, TP) the range is within the block they leave.

    Example:
        >>> flat_range(dt)  # one rank holds all; with RaggedShard((0,), (1, 3)) rank 1: (8, 32)
        (0, 32)
    """
    axis, placement = _ragged_axis(dt)
    spec = spec_of(dt)
    if isinstance(placement, StridedRaggedShard):
        found = strided_axes(spec.placements)
        assert found is not None
        row = dt.numel() // dt.shape[0] if dt.shape[0] else 0
        lo, hi = placement.chunk_rows(
            dt.shape,
            dt.device_mesh.size(axis),
            dt.device_mesh.get_local_rank(axis),
            dt.device_mesh.get_local_rank(found[2]),
        )
        return lo * row, hi * row
    shape = block_shape(spec, axis)
    return placement.flat_range(shape, dt.device_mesh.get_local_rank(axis))


def local_view(dt: DTensor) -> torch.Tensor:
    """The flat local piece viewed as (-1, *shape[k:]): whole rows of the trailing dims.

    Example:
        >>> local_view(dt).shape, dt.to_local().shape
        (torch.Size([8, 4]), torch.Size([32]))
    """
    axis, placement = _ragged_axis(dt)
    if isinstance(placement, StridedRaggedShard):
        return dt.to_local().view(-1, *dt.shape[1:])
    shape = block_shape(spec_of(dt), axis)
    return dt.to_local().view(-1, *shape[len(placement.dims) :])
