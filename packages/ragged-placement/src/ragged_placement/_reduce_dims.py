"""Reductions along dims of a RaggedShard tensor (`torch.linalg.norm(weight, dim=1)`).

The ops: `sum(dim)`, `mean(dim)`, `amax`, `amin` and `linalg_vector_norm(dim=...)`.

RaggedShard cuts only the leading `dims` (every piece is whole rows of the trailing ones), so
a reduction over trailing dims alone is local: each rank reduces `local_view` (its rows) and
the result is RaggedShard over the same leading dims with the same shares, no communication.
A reduction that includes a cut dim needs every rank's rows: the input is gathered once
(`full_tensor`) and the result is Replicate, as DTensor does for Shard inputs it cannot
reduce locally. The same happens with other placements on the mesh that are not Replicate.
Whole-tensor reductions (no dim) keep their Partial rules (`_ops.py`).

These run as DTensor op handlers (below autograd): the forward is exact. Their backward
broadcasts the reduced tensor against the input, which the elementwise rule refuses with a
clear error; differentiate through `local_view(dt)` or a redistributed tensor instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from ragged_placement._compat import (
    DTensorSpec,
    OpCall,
    TensorMeta,
    are_we_tracing,
    contiguous_strides,
    local_of,
    make_dtensor,
    spec_of,
)
from ragged_placement._placement import RaggedShard, StridedRaggedShard
from ragged_placement._redistribute import block_shape

aten = torch.ops.aten
# op -> where its `dim` argument is: (position in args, keyword name)
_DIM_ARG = {
    aten.sum.dim_IntList: (1, "dim"),
    aten.mean.dim: (1, "dim"),
    aten.amax.default: (1, "dim"),
    aten.amin.default: (1, "dim"),
    aten.linalg_vector_norm.default: (2, "dim"),
}


def reduction_ops() -> list[Any]:
    """The reductions along dims that `run` handles."""
    return list(_DIM_ARG)


def _dims_of(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> list[int]:
    position, name = _DIM_ARG[op]
    value = args[position] if len(args) > position else kwargs.get(name)
    if value is None or (isinstance(value, list | tuple) and not value):
        return list(range(ndim))  # every dim (amax's `dim=[]`, norm's `dim=None`)
    dims = [value] if isinstance(value, int) else list(value)
    return sorted({d % max(ndim, 1) for d in dims})


def run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fallback: OpCall) -> object:
    """`op(*args, **kwargs)` for a RaggedShard first argument; anything else to `fallback`."""
    x = args[0] if args else None
    if not isinstance(x, DTensor) or are_we_tracing():
        return fallback(op, args, kwargs)
    spec = spec_of(x)
    ragged = [(a, p) for a, p in enumerate(spec.placements) if isinstance(p, RaggedShard)]
    strided = any(isinstance(p, StridedRaggedShard) for p in spec.placements)
    if not ragged and not strided:
        return fallback(op, args, kwargs)
    dims = _dims_of(op, args, kwargs, x.ndim)
    whole = dims == list(range(max(x.ndim, 1)))
    if whole and op in (aten.sum.dim_IntList, aten.mean.dim, aten.linalg_vector_norm.default):
        return fallback(op, args, kwargs)  # a whole-tensor reduction: its Partial rule
    meta = op(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    out_meta = TensorMeta(meta.shape, contiguous_strides(meta.shape), meta.dtype)
    others_replicated = len(ragged) == 1 and all(
        isinstance(p, Replicate) for a, p in enumerate(spec.placements) if a != ragged[0][0]
    )
    if others_replicated and not strided:
        axis, placement = ragged[0]
        cut = len(placement.dims)
        if dims[0] >= cut:  # trailing dims only: each rank reduces its own rows
            rows = local_of(x).view(-1, *block_shape(spec, axis)[cut:])
            local_dims = [d - cut + 1 for d in dims]
            position, name = _DIM_ARG[op]
            local_args = list(args)
            local_kwargs = dict(kwargs)
            if len(args) > position:
                local_args[position] = local_dims
            else:
                local_kwargs[name] = local_dims
            local_args[0] = rows
            out = op(*local_args, **local_kwargs).reshape(-1)
            out_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=out_meta)
            return make_dtensor(out, out_spec, requires_grad=False)
    out = op(x.full_tensor(), *args[1:], **kwargs)
    replicated = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=out_meta)
    return make_dtensor(out, replicated, requires_grad=False)
