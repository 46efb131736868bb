"""Views of a RaggedShard tensor that keep row-major order keep the shard.

The ops: `view` (so `reshape`, `flatten` and `unflatten` of a contiguous tensor).

A RaggedShard piece is a contiguous range of the row-major flattening, and a view of a
contiguous tensor changes the shape, not that flattening: each rank keeps its local tensor
(the view aliases it: its local call is `view(local, [local numel])`) with the same shares.
Only the cut dims change, to the fewest leading dims of the new shape whose rows a unit
(`numel / sum(local_units)` elements) is made of. So a view of a sharded fused weight stays
sharded and writes through it reach the parameter.

An identity view is refused: `param.view_as(param)` is how torch's split-backward pipeline
schedules reach a parameter's gradient accumulator, and for a sharded parameter that forward
did not use (it computed with the gathered one) none is ever reached: the caller would
silently compute no gradient. Views of a tensor with other non-Replicate placements, or of a
non-contiguous one, gather it (the result is Replicate), as DTensor does when it cannot keep
a Shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Replicate

from ragged_placement._compat import (
    DTensorSpec,
    OpSchema,
    OutputSharding,
    contiguous_strides,
    rewritten_call,
)
from ragged_placement._placement import RaggedShard, cut_dims_for
from ragged_placement._redistribute import block_shape

aten = torch.ops.aten
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default})


def keeps_shard(spec: object) -> bool:
    """Whether a view of `spec` can keep its RaggedShard (see the module docstring)."""
    if not isinstance(spec, DTensorSpec):
        return False
    ragged = [p for p in spec.placements if isinstance(p, RaggedShard)]
    others = [p for p in spec.placements if not isinstance(p, RaggedShard)]
    meta = spec.tensor_meta
    contiguous = meta is not None and tuple(meta.stride) == contiguous_strides(meta.shape)
    return len(ragged) == 1 and contiguous and all(isinstance(p, Replicate) for p in others)


def propagate_view(op_schema: OpSchema, meta: Any, refuse: type[Exception]) -> OutputSharding:
    """The sharding of `view(ragged, shape)`: the same pieces under the new shape."""
    spec = op_schema.args_schema[0]
    assert isinstance(spec, DTensorSpec) and keeps_shard(spec)
    shape = tuple(meta.shape)
    if shape == tuple(spec.shape):
        raise refuse(
            f"an identity view of a RaggedShard tensor of shape {shape} (`t.view_as(t)`): "
            f"refused, because it is how torch's split-backward pipeline schedules reach a "
            f"parameter's gradient accumulator, and a sharded parameter that forward did not "
            f"use has none in the graph (no gradient, silently). With fully_shard under such a "
            f"schedule pass reshard_after_forward=False; elsewhere use the tensor itself"
        )
    axis, placement = next(
        (a, p) for a, p in enumerate(spec.placements) if isinstance(p, RaggedShard)
    )
    total = sum(placement.local_units)
    unit = math.prod(shape) // total if total else 0
    placements = list(spec.placements)
    placements[axis] = RaggedShard(cut_dims_for(shape, unit), placement.local_units)
    out = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)
    lo, hi = placement.flat_ranges(block_shape(spec, axis), spec.mesh.size(axis))[
        spec.mesh.get_local_rank(axis)
    ]
    local_call = OpSchema(op_schema.op, (spec, [hi - lo]), {}, schema_info=op_schema.schema_info)
    return rewritten_call(out, local_call)
