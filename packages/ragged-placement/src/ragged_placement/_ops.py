"""Sharding rules for ops on RaggedShard DTensors.

torch's DTensor computes an op on the local tensors once sharding propagation has said which
spec each input must have and which spec the output gets. For a RaggedShard input we answer
that question ourselves (see `_compat.install`):

- elementwise ops (aten ops tagged pointwise, `*_like` factories, copies, dtype casts) and
  their `_foreach_*` forms: every tensor operand must have the same spec as the first
  RaggedShard operand (a same-shape operand with another spec is redistributed to it; a 0-dim
  tensor or a Python scalar broadcasts as is). The output keeps the spec; the local op runs on
  the flat pieces, which is exact for any elementwise op. An out-of-place op with an operand
  of another shape (broadcast) gathers its operands and gives Replicate.
- whole-tensor reductions (`sum`, `mean`, `linalg_vector_norm`, `_foreach_norm` without
  `dim`): each rank reduces its piece and the output is Partial on the sharded mesh axes, so
  `full_tensor()` (or any later op) reduces across ranks: sum -> Partial("sum"), p-norm ->
  torch's norm partial, mean -> a partial that weights each rank's mean by its share of the
  elements (an empty piece contributes nothing). `any` is the exception: it gathers its
  (bool) input and replicates the result, because `.item()` of a Partial reads the local value
  and `while mask.any():` must take the same branch on every rank.
- random fills in place (`normal_`, `uniform_`, `bernoulli_`: what `nn.init` runs): the
  tensor keeps its spec; the values are drawn for the whole tensor on every rank from the
  same generator state and each rank keeps its piece (`_integration.RaggedHooks.random_fill`),
  so they equal one process's draw and do not depend on the world size.
- views that keep row-major order (`view`, so `reshape` / `flatten` / `unflatten`) keep the
  pieces under the new shape (`_view_ops.py`); `new_*` factories give Replicate tensors of the
  size asked for, with no communication; joins (`cat`, `stack`) and reductions along dims
  gather their inputs once and give Replicate.
- anything else raises an error naming the op and the way out (redistribute first); so do
  views that cannot keep the pieces (`t`, `transpose`, `permute`, `unsqueeze`), since a
  gathered copy would silently drop writes made through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ragged_placement._compat import (
    DTensorSpec,
    OpOverload,
    OpSchema,
    OutputSharding,
    TensorMeta,
    WeightedMeanPartial,
    dtensor_random_ops,
    norm_partial,
    op_arguments,
)
from ragged_placement._placement import RaggedShard, StridedRaggedShard, chunk_range
from ragged_placement._view_ops import VIEWS, keeps_shard, propagate_view

aten = torch.ops.aten

_ELEMENTWISE_EXTRA = {
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.detach.default,
    aten.alias.default,
    aten.copy_.default,
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.clone.default,
}
_REDUCTIONS = {
    aten.sum.default: "sum",
    aten.mean.default: "mean",
    aten.any.default: "any",
    aten.linalg_vector_norm.default: "norm",
    aten._foreach_norm.Scalar: "norm",
}


# Factories shaped by their arguments: the input lends only dtype and device, so the result is
# a Replicate tensor of the size asked for, made on every rank without communication (as
# DTensor does for Shard inputs; torchtitan's fused-qkv init draws its values into them).
_NEW_FACTORIES = frozenset(
    {
        aten.new_empty.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
        aten.new_empty_strided.default,
    }
)
# Ops that make a new tensor from every element: the inputs are gathered once and the result
# is Replicate, as DTensor does when it cannot keep a Shard. Joins, and reductions along dims
# (`torch.linalg.norm(w, dim=1)`; whole-tensor ones keep their Partial rules). Views that
# cannot keep row-major order (`t`, `transpose`, `permute`, `unsqueeze`) are not among them:
# a gathered copy would silently drop what is written through it.
_GATHERED = frozenset(
    {
        aten.cat.default,
        aten.stack.default,
        aten.sum.dim_IntList,
        aten.mean.dim,
        aten.amax.default,
        aten.amin.default,
    }
)


class UnsupportedRaggedOpError(NotImplementedError):
    """An op that has no RaggedShard rule; the message says how to get past it."""


def has_ragged(spec: object) -> bool:
    """Whether `spec` (a DTensorSpec) places any mesh axis with RaggedShard."""
    return isinstance(spec, DTensorSpec) and any(
        isinstance(p, RaggedShard | StridedRaggedShard) for p in spec.placements
    )


def schema_has_ragged(op_schema: OpSchema) -> bool:
    """Whether any tensor argument of the op is a RaggedShard DTensor."""
    for arg in (*op_schema.args_schema, *op_schema.kwargs_schema.values()):
        if has_ragged(arg):
            return True
        if isinstance(arg, (list, tuple)) and any(has_ragged(a) for a in arg):
            return True
    return False


def _is_elementwise(op: OpOverload) -> bool:
    return torch.Tag.pointwise in op.tags or op in _ELEMENTWISE_EXTRA


def is_foreach_elementwise(op: OpOverload) -> bool:
    """Whether `op` is a `_foreach_*` op whose per-entry op is elementwise."""
    name = op.__name__  # e.g. "_foreach_add_.Scalar"
    if not name.startswith("_foreach_"):
        return False
    base_name = name[len("_foreach_") :].split(".")[0]
    # In-place forms: `add_` is an aten op of its own, `maximum_` is not (only `maximum`).
    base = getattr(aten, base_name, None) or getattr(aten, base_name.rstrip("_"), None)
    if base is None:
        return False
    return any(_is_elementwise(getattr(base, o)) for o in base.overloads())


def is_columnwise(op: OpOverload) -> bool:
    """Whether a foreach op decides each list entry on its own (elementwise, `_foreach_norm`)."""
    return op is aten._foreach_norm.Scalar or is_foreach_elementwise(op)


def _with_meta(
    spec: DTensorSpec, meta: TensorMeta | None, placements: Sequence[Placement]
) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta or spec.tensor_meta)


def _align_operand(arg: object, ref: DTensorSpec, op: object) -> object:
    """The spec an operand must have to be combined elementwise with `ref`."""
    if not isinstance(arg, DTensorSpec):
        return arg
    if arg.mesh != ref.mesh:
        raise ValueError(f"{op}: operands live on different meshes ({arg.mesh} vs {ref.mesh})")
    if arg.placements == ref.placements and arg.shape == ref.shape:
        return arg
    if arg.ndim == 0 and all(p.is_replicate() for p in arg.placements):
        return arg  # a replicated scalar broadcasts against any local piece
    if arg.shape != ref.shape:
        raise UnsupportedRaggedOpError(
            f"{op}: cannot broadcast an operand of shape {tuple(arg.shape)} against a "
            f"RaggedShard tensor of shape {tuple(ref.shape)}; RaggedShard operands must have the "
            f"same shape (or be 0-dim). Redistribute to Replicate or Shard first."
        )
    return DTensorSpec(ref.mesh, ref.placements, tensor_meta=arg.tensor_meta)


def _writes_first_arg(op: OpOverload) -> bool:
    arguments = op_arguments(op)
    first = arguments[0] if arguments else None
    return first is not None and first.alias_info is not None and first.alias_info.is_write


# The random ops torch's DTensor dispatcher runs through Python (so that their values can be
# made independent of the sharding); the in-place fills among them get RaggedShard support.
DTENSOR_RANDOM_OPS = dtensor_random_ops()
RANDOM_FILLS = frozenset(op for op in DTENSOR_RANDOM_OPS if _writes_first_arg(op))


def _elementwise(op_schema: OpSchema, metas: Any, args: Sequence[object]) -> OutputSharding:
    self_spec = op_schema.args_schema[0] if op_schema.args_schema else None
    if _writes_first_arg(op_schema.op) and isinstance(self_spec, DTensorSpec):
        # In place: the tensor written keeps its spec; the other operands adapt to it.
        ref: object = self_spec
    else:
        ref = next(a for a in args if has_ragged(a))
    assert isinstance(ref, DTensorSpec)
    broadcast = any(
        isinstance(a, DTensorSpec) and a.ndim != 0 and a.shape != ref.shape for a in args
    )
    if broadcast and not _writes_first_arg(op_schema.op) and isinstance(metas, TensorMeta):
        # An operand broadcast against a RaggedShard one (a norm along a dim's backward:
        # `grad / norm` unsqueezed against the input): the pieces do not line up, so the
        # operands are gathered and the result is Replicate (a new tensor: nothing aliased).
        return _gathered(op_schema, metas)
    new_args = tuple(_align_operand(a, ref, op_schema.op) for a in op_schema.args_schema)
    new_kwargs = {
        k: _align_operand(v, ref, op_schema.op) for k, v in op_schema.kwargs_schema.items()
    }
    return _finish(op_schema, new_args, new_kwargs, _specs_like(ref, metas))


def _foreach(op_schema: OpSchema, metas: Any) -> OutputSharding:
    lists = [a for a in op_schema.args_schema if isinstance(a, (list, tuple))]
    length = len(lists[0])
    in_place = _writes_first_arg(op_schema.op)
    refs: list[DTensorSpec | None] = []
    for i in range(length):
        column = [lst[i] for lst in lists if len(lst) == length]
        if in_place and isinstance(column[0], DTensorSpec):
            refs.append(column[0])  # the tensor written keeps its spec
        else:
            refs.append(next((a for a in column if has_ragged(a)), None))

    def align(arg: object) -> object:
        if isinstance(arg, (list, tuple)) and len(arg) == length:
            return type(arg)(
                _align_operand(a, ref, op_schema.op) if ref is not None else a
                for a, ref in zip(arg, refs, strict=True)
            )
        if isinstance(arg, DTensorSpec) and any(r is not None for r in refs):
            # One tensor for every list entry (e.g. clip_grad_norm_'s clip coefficient):
            # it must be a scalar, replicated so that every piece sees the same value.
            if arg.ndim != 0:
                raise UnsupportedRaggedOpError(
                    f"{op_schema.op}: a single tensor operand of shape {tuple(arg.shape)} next to "
                    "RaggedShard lists; only 0-dim tensors broadcast to every entry"
                )
            if not all(p.is_replicate() for p in arg.placements):
                return DTensorSpec(
                    arg.mesh, (Replicate(),) * arg.mesh.ndim, tensor_meta=arg.tensor_meta
                )
        return arg

    new_args = tuple(align(a) for a in op_schema.args_schema)
    new_kwargs = {k: align(v) for k, v in op_schema.kwargs_schema.items()}
    if metas is None:
        out: Any = None
    else:
        first = lists[0]
        out = [
            _specs_like(cast(DTensorSpec, ref or first[i]), meta) if meta is not None else None
            for i, (ref, meta) in enumerate(zip(refs, metas, strict=True))
        ]
    return _finish(op_schema, new_args, new_kwargs, out)


def _specs_like(ref: DTensorSpec, metas: Any) -> Any:
    if metas is None:
        return None
    if isinstance(metas, TensorMeta):
        if metas.shape != ref.shape:
            raise UnsupportedRaggedOpError(
                f"an elementwise op changed the shape {tuple(ref.shape)} -> {tuple(metas.shape)} "
                "of a RaggedShard tensor"
            )
        return _with_meta(ref, metas, ref.placements)
    return type(metas)(_specs_like(ref, m) if m is not None else None for m in metas)


def _finish(
    op_schema: OpSchema, args: tuple[object, ...], kwargs: dict[str, object], out: Any
) -> OutputSharding:
    changed = args != tuple(op_schema.args_schema) or kwargs != dict(op_schema.kwargs_schema)
    if not changed:
        return OutputSharding(out)
    schema = OpSchema(op_schema.op, args, kwargs, schema_info=op_schema.schema_info)
    return OutputSharding(out, redistribute_schema=schema, needs_redistribute=True)


def _as_float(value: object) -> float:
    if not isinstance(value, int | float):
        raise UnsupportedRaggedOpError(f"norm order must be a number, got {value!r}")
    return float(value)


def _reduction(op_schema: OpSchema, kind: str, metas: Any) -> OutputSharding:
    args = op_schema.args_schema
    if op_schema.op is aten._foreach_norm.Scalar:
        specs = args[0]
        ord_ = _as_float(args[1] if len(args) > 1 else 2.0)
        assert isinstance(specs, (list, tuple))
        out = [
            reduced_spec(s, m, "norm", ord_) if isinstance(s, DTensorSpec) else None
            for s, m in zip(specs, metas, strict=True)
        ]
        return OutputSharding(out)
    spec = args[0]
    assert isinstance(spec, DTensorSpec)
    if kind == "any":
        # Its result steers Python control flow (`while mask.any():` in nn.init.trunc_normal_),
        # and `.item()` of a Partial DTensor reads the local value: every rank must get the
        # same answer, so the input is gathered (a bool per element) and the result replicated.
        whole = DTensorSpec(
            spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta
        )
        replicated = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=metas)
        return _finish(op_schema, (whole, *args[1:]), dict(op_schema.kwargs_schema), replicated)
    if kind == "norm":
        norm_ord = _as_float(args[1] if len(args) > 1 else op_schema.kwargs_schema.get("ord", 2))
        dim = args[2] if len(args) > 2 else op_schema.kwargs_schema.get("dim")
        if dim is not None:  # along dims: gathered, as the other reductions along dims
            return _gathered(op_schema, metas)
        return OutputSharding(reduced_spec(spec, metas, kind, norm_ord))
    return OutputSharding(reduced_spec(spec, metas, kind, 0.0))


def reduced_spec(spec: DTensorSpec, meta: TensorMeta, kind: str, ord_: float) -> DTensorSpec:
    """The spec of a whole-tensor reduction (`kind`: sum, norm or mean) of `spec`."""
    strided = any(isinstance(p, StridedRaggedShard) for p in spec.placements)
    if strided and kind == "mean":
        # Chunk sizes depend on the piece, so rank shares do not factor per mesh axis.
        raise UnsupportedRaggedOpError(
            "mean of a StridedRaggedShard tensor; use sum() / numel instead"
        )
    placements: list[Placement] = []
    for axis, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard | StridedRaggedShard | Shard):
            if kind == "sum":
                placements.append(Partial("sum"))
            elif kind == "norm":
                placements.append(norm_partial(ord_))
            else:
                placements.append(WeightedMeanPartial(_shares(spec, axis)))
        elif isinstance(p, Replicate):
            placements.append(p)
        else:
            raise UnsupportedRaggedOpError(
                f"a whole-tensor {kind} of a RaggedShard tensor that is also {p} on mesh axis "
                f"{axis}; reduce that axis first"
            )
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)


def _shares(spec: DTensorSpec, axis: int) -> tuple[float, ...]:
    p = spec.placements[axis]
    if isinstance(p, RaggedShard):
        total = sum(p.local_units)
        return tuple(u / total for u in p.local_units)
    assert isinstance(p, Shard)
    size, parts = spec.shape[p.dim], spec.mesh.size(axis)
    if not size:
        return (0.0,) * parts
    return tuple((hi - lo) / size for lo, hi in (chunk_range(size, parts, i) for i in range(parts)))


def _replicated(spec: object, meta: Any) -> DTensorSpec:
    assert isinstance(spec, DTensorSpec)
    return DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=meta)


def _gathered(op_schema: OpSchema, meta: Any) -> OutputSharding:
    """Every DTensor operand (also inside a list) gathered; the result Replicate."""

    def whole(arg: object) -> object:
        if isinstance(arg, DTensorSpec):
            return _replicated(arg, arg.tensor_meta)
        if isinstance(arg, (list, tuple)):
            return type(arg)(whole(a) for a in arg)
        return arg

    args = tuple(whole(a) for a in op_schema.args_schema)
    first = _first_spec(op_schema.args_schema)
    assert first is not None
    return _finish(op_schema, args, dict(op_schema.kwargs_schema), _replicated(first, meta))


def _first_spec(args: Sequence[object]) -> DTensorSpec | None:
    for arg in args:
        if isinstance(arg, DTensorSpec):
            return arg
        if isinstance(arg, (list, tuple)):
            found = _first_spec(arg)
            if found is not None:
                return found
    return None


def propagate(op_schema: OpSchema, tensor_meta: Callable[[OpSchema], Any]) -> OutputSharding:
    """The output sharding of an op with at least one RaggedShard input (see module doc)."""
    op = op_schema.op
    flat_args = [*op_schema.args_schema, *op_schema.kwargs_schema.values()]
    if op in _REDUCTIONS:
        return _reduction(op_schema, _REDUCTIONS[op], tensor_meta(op_schema))
    if op in _NEW_FACTORIES:
        return OutputSharding(_replicated(op_schema.args_schema[0], tensor_meta(op_schema)))
    if op in _GATHERED:
        return _gathered(op_schema, tensor_meta(op_schema))
    if op in VIEWS:
        if keeps_shard(op_schema.args_schema[0]):
            return propagate_view(op_schema, tensor_meta(op_schema), UnsupportedRaggedOpError)
        return _gathered(op_schema, tensor_meta(op_schema))  # a copy, as DTensor's reshape
    if op in DTENSOR_RANDOM_OPS:
        if op not in RANDOM_FILLS or not has_ragged(op_schema.args_schema[0]):
            raise UnsupportedRaggedOpError(
                f"{op} on a RaggedShard tensor: random ops are supported as in-place fills of "
                f"a RaggedShard tensor ({', '.join(sorted(str(o) for o in RANDOM_FILLS))}). "
                "Fill a tensor of the shape you need, or redistribute first."
            )
        return OutputSharding(op_schema.args_schema[0])
    if is_foreach_elementwise(op):
        return _foreach(op_schema, tensor_meta(op_schema))
    if _is_elementwise(op):
        return _elementwise(op_schema, tensor_meta(op_schema), flat_args)
    raise UnsupportedRaggedOpError(
        f"{op} has no sharding rule for RaggedShard inputs (supported: elementwise ops, "
        "_foreach_* elementwise ops, whole-tensor sum, mean, any, linalg_vector_norm, "
        "_foreach_norm, reductions along dims and cat / stack (on gathered inputs), views that "
        "keep row-major order, new_* factories, in-place random fills). Redistribute to "
        "Replicate or Shard first, or "
        "work on ragged_placement.local_view(...)."
    )
