"""Views of a RaggedShard DTensor's local piece."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from ragged_placement._compat import (
    local_of,
    locals_and_specs_of,
    make_dtensor,
    make_dtensors,
    spec_of,
)
from ragged_placement._placement import RaggedShard, StridedRaggedShard
from ragged_placement._redistribute import block_shape, ragged_ranges, strided_axes


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
    return ragged_ranges(spec, axis)[dt.device_mesh.get_local_rank(axis)]


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


def with_local(dt: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor like `dt` (mesh, placements, global shape) whose local tensor is `local`.

    For building many DTensors of a known layout over new memory (an optimizer's state, a
    reduced gradient): no collective and no re-validation of the placements, which makes it
    ~20x cheaper than `DTensor.from_local`. Not tracked by autograd.

    Args:
        dt: A DTensor whose spec to reuse (any placements, RaggedShard or not).
        local: This rank's piece: the same shape, dtype and device as `dt.to_local()`.

    Returns:
        A DTensor over `local` (no copy).

    Raises:
        TypeError: `dt` is not a DTensor or `local` not a plain tensor.
        ValueError: `local`'s shape, dtype or device differs from `dt`'s local tensor.

    Example:
        >>> grad = with_local(dt, torch.zeros_like(dt.to_local()))
        >>> grad.placements == dt.placements, grad.shape == dt.shape
        (True, True)
    """
    if not isinstance(dt, DTensor):
        raise TypeError(f"with_local: expected a DTensor, got {type(dt).__name__}")
    value: object = local  # callers may pass anything; check before use
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        raise TypeError(f"with_local: local must be a plain tensor, got {type(value).__name__}")
    mine = local_of(dt)
    if (local.shape, local.dtype, local.device) != (mine.shape, mine.dtype, mine.device):
        raise ValueError(
            f"with_local: local must match the DTensor's local tensor ({tuple(mine.shape)}, "
            f"{mine.dtype}, {mine.device}), got ({tuple(local.shape)}, {local.dtype}, "
            f"{local.device})"
        )
    return make_dtensor(local, spec_of(dt), requires_grad=False)


def with_locals(dts: Sequence[DTensor], locals_: Sequence[torch.Tensor]) -> list[DTensor]:
    """`with_local` for many DTensors at once: one pass of checks, one constructor each.

    For per-step work over every parameter (the reduced gradients of an FSDP group): the
    checks read attributes of whole lists, so the host cost per DTensor is the construction.

    Args:
        dts: DTensors whose specs to reuse.
        locals_: The local tensors, in the same order (see `with_local`).

    Returns:
        The new DTensors, in order.

    Raises:
        TypeError, ValueError: As `with_local`, naming the first offending position.

    Example:
        >>> grads = with_locals([dt, dt], [torch.zeros_like(dt.to_local())] * 2)
        >>> [g.placements == dt.placements for g in grads]
        [True, True]
    """
    dts, locals_ = list(dts), list(locals_)
    if len(dts) != len(locals_):
        raise ValueError(f"with_locals: {len(dts)} DTensors but {len(locals_)} local tensors")
    if not {dt.__class__ for dt in dts} <= {DTensor}:
        for dt in dts:
            if not isinstance(dt, DTensor):
                raise TypeError(f"with_locals: expected DTensors, got {type(dt).__name__}")
    mine, specs = locals_and_specs_of(dts)
    if not (
        {t.__class__ for t in locals_} <= {torch.Tensor}
        and [(t.shape, t.dtype, t.device) for t in mine]
        == [(t.shape, t.dtype, t.device) for t in locals_]
    ):
        for dt, local in zip(dts, locals_, strict=True):
            with_local(dt, local)  # raises, naming the first mismatch
    return make_dtensors(locals_, specs)
