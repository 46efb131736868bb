"""Elementwise foreach ops on RaggedShard DTensors of one layout per entry: run on the locals.

An optimizer step (torch's AdamW with `foreach=True`, `clip_grad_norm_`) runs about fifteen
elementwise `_foreach_*` ops over every parameter. DTensor dispatches each op entry by entry:
in C++ when its sharding cache knows the whole list, and in Python (unwrap, propagate, wrap:
several calls per entry) when the list is new - every step of an MoE whose unused experts have
no gradient, since the set of parameters with one changes. For an elementwise op whose entry
i has, in every list, the placements, mesh and local shape of entry i of the first list (no
Partial), and whose other arguments are numbers or replicated 0-d DTensors, the result is the
op on the local tensors: nothing moves. `run` does exactly that in one pass over the lists.

The fused optimizer kernels (`_fused_adamw_`, `_fused_adam_`, `_fused_sgd_`: torch's
`fused=True`, torchtitan's default) are elementwise per entry too and take the same path; their
per-parameter step counts are plain 0-d tensors and `max_exp_avg_sqs` is empty without amsgrad.

Every other call (no RaggedShard in the first list, layouts that differ, plain tensors,
tracing) goes to DTensor's own dispatch, unchanged.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from ragged_placement._compat import (
    DTensorSpec,
    OpCall,
    TensorMeta,
    are_we_tracing,
    dtensor_locals,
    local_of,
    make_dtensors,
    op_arguments,
    specs_of,
)
from ragged_placement._ops import is_foreach_elementwise, reduced_spec
from ragged_placement._placement import RaggedShard, StridedRaggedShard

aten = torch.ops.aten
_RAGGED = (RaggedShard, StridedRaggedShard)
_NUMBERS = (bool, int, float, complex)
_NUMBER_CLASSES = frozenset(_NUMBERS)
# Foreach reductions, which `is_foreach_elementwise` lets through (an overload of their base
# op is elementwise: `max.other`); the shape check in `run` would refuse them too. Of them,
# `_foreach_norm` (clip_grad_norm_'s) has a path of its own: each entry's norm is a partial.
_REDUCTIONS = frozenset({"_foreach_max", "_foreach_norm"})
_NORM = aten._foreach_norm.Scalar
_FUSED_NAMES = ("_fused_adamw_", "_fused_adam_", "_fused_sgd_")


def fused_ops() -> list[Any]:
    """Every overload of torch's fused optimizer kernels that this torch has."""
    ops: list[Any] = []
    for name in _FUSED_NAMES:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.extend(getattr(packet, overload) for overload in packet.overloads())
    return ops


_FUSED_OPS = frozenset(fused_ops())


def foreach_ops() -> list[Any]:
    """Every overload of an elementwise `_foreach_*` op whose first argument is a list."""
    ops = []
    for name in dir(aten):
        if not name.startswith("_foreach_") or name in _REDUCTIONS:
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            arguments = op_arguments(op)
            takes_list = bool(arguments) and str(arguments[0].type) == "List[Tensor]"
            if takes_list and is_foreach_elementwise(op):
                ops.append(op)
    return [*ops, _NORM, *fused_ops()]


def run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fallback: OpCall) -> object:
    """`op(*args, **kwargs)` on the local tensors, or through `fallback` (see the docstring)."""
    if op is _NORM:
        return _norms(args, kwargs, fallback)
    locals_ = None if are_we_tracing() else _local_args(args, kwargs, fused=op in _FUSED_OPS)
    if locals_ is None:
        return fallback(op, args, kwargs)
    local_args, local_kwargs, specs = locals_
    out = op(*local_args, **local_kwargs)
    if out is None:  # in place (or into `out=`): the DTensors hold the new values
        return None
    if not _outputs_match(out, local_args[0], specs):  # a dtype promotion: DTensor decides
        return fallback(op, args, kwargs)
    return make_dtensors(out, specs)


def _norms(args: tuple[Any, ...], kwargs: dict[str, Any], fallback: OpCall) -> object:
    """`_foreach_norm`: each entry's local norm, as a partial norm over the sharded axes."""
    ord_ = args[1] if len(args) > 1 else 2
    extra = set(kwargs) - {"dtype"}
    locals_ = None
    if not are_we_tracing() and isinstance(ord_, int | float) and not extra:
        locals_ = _local_args(args[:1], {})
    if locals_ is None:
        return fallback(_NORM, args, kwargs)
    (local_list,), _, specs = locals_
    out = _local_norms(local_list, ord_, kwargs)
    keys = [(id(spec), ord_, t.dtype) for spec, t in zip(specs, out, strict=True)]
    known = _SEEN.norm_specs
    if known.keys() >= set(keys):
        return make_dtensors(out, [known[key] for key in keys])
    out_specs = []
    for key, spec, t in zip(keys, specs, out, strict=True):
        found = known.get(key)
        if found is None:
            _SEEN.keep(spec)  # first: it may drop what is cached, never what is built here
            found = reduced_spec(spec, TensorMeta(torch.Size(()), (), t.dtype), "norm", ord_)
            known[key] = found
        out_specs.append(found)
    return make_dtensors(out, out_specs)


def _local_norms(
    locals_: list[torch.Tensor], ord_: float, kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    if not math.isinf(ord_) or all(t.numel() for t in locals_):
        return list(_NORM(locals_, ord_, **kwargs))
    # A rank's empty piece has no max (or min) of its own: it contributes the identity of
    # the max of non-negative norms (0) or of the min (inf), which aten refuses to make up.
    full = [t for t in locals_ if t.numel()]
    norms = iter(_NORM(full, ord_, **kwargs) if full else ())
    fill = 0.0 if ord_ > 0 else math.inf
    return [
        next(norms)
        if t.numel()
        else torch.full((), fill, dtype=kwargs.get("dtype") or t.dtype, device=t.device)
        for t in locals_
    ]


class _Seen:
    """What was checked once, by identity: placements that qualify, pairs of equal specs.

    The checks run per list entry and would cost Python calls per entry on every op (a
    placement's `isinstance` and `__eq__` run in Python); the lists hold the same spec objects
    step after step, so each is checked once. The objects are kept alive while they are
    here (an id is never reused meanwhile), and everything is dropped when it grows large.
    """

    def __init__(self, max_size: int = 1 << 17) -> None:
        self.max_size = max_size
        self.placements: set[int] = set()  # ids of placements with a RaggedShard, no Partial
        self.equal: set[tuple[int, int]] = set()  # (id, id) of specs of one layout
        # (id of a spec, order, dtype) -> the spec of that entry's norm
        self.norm_specs: dict[tuple[int, Any, Any], DTensorSpec] = {}
        self._alive: list[object] = []

    def keep(self, *objects: object) -> None:
        if len(self._alive) > self.max_size:
            self.placements.clear()
            self.equal.clear()
            self.norm_specs.clear()
            self._alive.clear()
        self._alive.extend(objects)


_SEEN = _Seen()


def _qualifies(placements: tuple[Any, ...]) -> bool:
    return any(isinstance(p, _RAGGED) for p in placements) and not any(
        isinstance(p, Partial) for p in placements
    )


def _same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    return (
        a.mesh == b.mesh
        and a.placements == b.placements
        and a.tensor_meta is not None
        and b.tensor_meta is not None
        and a.tensor_meta.shape == b.tensor_meta.shape
    )


def _local_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, fused: bool = False
) -> tuple[list[Any], dict[str, Any], list[DTensorSpec]] | None:
    first = args[0]
    if not isinstance(first, list | tuple) or not first:
        return None
    if not {t.__class__ for t in first} <= {DTensor}:
        return None
    specs = specs_of(first)
    placements = [spec.placements for spec in specs]
    unseen = set(map(id, placements)) - _SEEN.placements
    if unseen:
        for entry in placements:
            if id(entry) in unseen:
                if not _qualifies(entry):
                    return None
                _SEEN.keep(entry)
                _SEEN.placements.add(id(entry))
    local_args: list[Any] = [dtensor_locals(first)]
    for arg in args[1:]:
        local = _local_arg(arg, specs, fused)
        if local is _REFUSED:
            return None
        local_args.append(local)
    local_kwargs = {}
    for name, value in kwargs.items():
        local = _local_arg(value, specs, fused)
        if local is _REFUSED:
            return None
        local_kwargs[name] = local
    return local_args, local_kwargs, specs


_REFUSED = object()


def _local_arg(arg: Any, specs: list[DTensorSpec], fused: bool = False) -> Any:
    if arg is None or isinstance(arg, _NUMBERS):
        return arg
    if fused and _plain_scalars(arg, len(specs)):
        return arg  # step counts (one 0-d tensor per parameter), an empty list, grad_scale
    if isinstance(arg, DTensor):  # a tensor scalar: fine if every rank holds the same one
        replicated = arg.dim() == 0 and all(isinstance(p, Replicate) for p in arg.placements)
        return local_of(arg) if replicated else _REFUSED
    if not isinstance(arg, list | tuple) or len(arg) != len(specs):
        return _REFUSED
    if not {t.__class__ for t in arg} <= {DTensor}:
        return arg if {v.__class__ for v in arg} <= _NUMBER_CLASSES else _REFUSED
    others = specs_of(arg)
    if not all(map(operator.is_, others, specs)):
        pairs = set(zip(map(id, others), map(id, specs), strict=True)) - _SEEN.equal
        if pairs:
            for other, spec in zip(others, specs, strict=True):
                if (id(other), id(spec)) in pairs:
                    if not _same_layout(other, spec):
                        return _REFUSED
                    _SEEN.keep(other, spec)
                    _SEEN.equal.add((id(other), id(spec)))
    return dtensor_locals(arg)


def _plain_scalars(arg: Any, length: int) -> bool:
    if type(arg) is torch.Tensor:
        return arg.dim() == 0
    if not isinstance(arg, list | tuple):
        return False
    if not arg:
        return True
    return len(arg) == length and all(type(t) is torch.Tensor and t.dim() == 0 for t in arg)


def _outputs_match(out: Any, inputs: Sequence[torch.Tensor], specs: Sequence[DTensorSpec]) -> bool:
    if not isinstance(out, list | tuple) or len(out) != len(specs):
        return False
    if [t.shape for t in out] != [t.shape for t in inputs]:
        return False
    return [t.dtype for t in out] == [s.tensor_meta.dtype if s.tensor_meta else None for s in specs]
