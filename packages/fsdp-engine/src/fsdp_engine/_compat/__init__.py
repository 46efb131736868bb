"""Every touch of a torch internal in fsdp_engine lives here, behind ragged_placement's guard.

- `queue_backward_callback(fn)`: `Variable._execution_engine.queue_callback`, which runs `fn`
  once the current backward pass has finished (the engine's end-of-backward work: reduce the
  groups no hook reached, wait for the reduce-scatters, hand out the sharded gradients).
- `in_backward()`: `torch._C._current_graph_task_id() != -1`, true while the autograd engine
  runs a backward pass on this thread (activation checkpointing recomputes forward there).
- `map_tensors(tree, fn)`: torch's pytree (`torch.utils._pytree`), which knows the containers
  libraries register with it (transformers' `ModelOutput`), as FSDP2 walks module inputs and
  outputs.
- `parameter_slots(module)`: `module._parameters`, the dict `nn.Module` keeps its own
  parameters in; the engine swaps sharded and gathered parameters in it directly
  (`register_parameter` would check and re-run hooks per parameter per step) and takes
  entries out around `nn.Module._apply`.
- `ApplyOverride`: a mixin overriding `nn.Module._apply`, the private method behind `.to()`,
  `.cuda()`, `to_empty()` and `.double()`; it hands the conversion to the class's
  `_fsdp_convert(fn, apply)` (the group's parameters are views of its DBuffers, which convert
  as one tensor each), where `apply()` runs nn.Module's own `_apply` on the rest.
- `profiler_range(name)`: `torch.profiler.record_function(name)` only while a profiler runs
  (`torch._C._autograd._profiler_enabled`): a range costs ~8 us even with no profiler, and
  a step enters a few per group.
- `TorchFSDPModule`, `TorchUnshardHandle`, `TorchGradientReductionHandle`: torch's public
  FSDP2 classes, which ours subclass so that `isinstance` checks in torch and in frameworks
  find our modules (the last is torch 2.15's; None before).
- `torch_fsdp_methods()`: the methods torch's `FSDPModule` defines on this torch, so that the
  engine can check it overrides every one (none may run torch's FSDP2 code on our state).
- `post_accumulate_grad_hooks(params)`: the hooks `Tensor.register_post_accumulate_grad_hook`
  registered on each parameter (torch keeps them in `_post_accumulate_grad_hooks`); autograd
  runs them on the gathered parameter's gradient, which is not the sharded one, so the engine
  runs them once the sharded `.grad` is handed out, as FSDP2 does.
- `set_fully_shard_state(module, ...)` / `fully_shard_state(module)`: torch's pipeline
  stages drive FSDP2's private per-module state; the shim that imitates it, with its table
  of what each torch version reads, is `_pipeline_state.py` (re-exported here).
- `placement_result(value)`: reads torch's `ShardPlacementResult` (torch 2.13+, a private
  dataclass of `_fully_shard._fsdp_common` that `shard_placement_fn` may return to put one
  parameter on its own mesh: experts beside expert parallelism) into (placement, mesh,
  shard axis, replicate axis, and its full SPMD mesh and `DataParallelMeshDims` where
  torch 2.15 made it from those); None for anything else.
- `dtensor_spec(dt)`: a DTensor's `_spec` (mesh and placements) read directly: the public
  `device_mesh` / `placements` are Python properties, and `clip_grad_norm_` asks every
  gradient every step (`_norm_keys.py` caches what it reads).
- `mark_fsdp_managed(module)`: the private marks torch's `fully_shard` sets on the modules
  it manages (`_is_fsdp_managed_module`, `_fsdp_use_orig_params`), which transformers and
  dynamo read.
- `flatten_axes(mesh, names)`: `DeviceMesh._flatten`, the one way to make one axis of several
  named ones (`DataParallelMeshDims(shard=("dp_shard", "cp"))`).
- `foreach_mul_`, `foreach_norm`: torch's multi-tensor ops (`torch._foreach_mul_`,
  `torch._foreach_norm`), what `clip_grad_norm_` runs over the flat runs.
- `all_gather_single`: torch.distributed's name since 2.13; before, the same collective is
  `all_gather_into_tensor` (chosen once, by which name exists).
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from ragged_placement import check_torch_version

__all__ = [
    "ApplyOverride",
    "TorchFSDPModule",
    "TorchGradientReductionHandle",
    "TorchUnshardHandle",
    "all_gather_single",
    "dtensor_spec",
    "flatten_axes",
    "foreach_mul_",
    "foreach_norm",
    "fully_shard_state",
    "in_backward",
    "map_tensors",
    "mark_fsdp_managed",
    "parameter_slots",
    "placement_result",
    "post_accumulate_grad_hooks",
    "profiler_range",
    "queue_backward_callback",
    "set_fully_shard_state",
    "torch_fsdp_methods",
]

# A DTensor's spec, read as an attribute (in C when mapped over a list).
dtensor_spec = operator.attrgetter("_spec")

# torch's multi-tensor ops (what clip_grad_norm_'s foreach path runs), underscored in torch.
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

TorchFSDPModule = torch_fsdp.FSDPModule
TorchUnshardHandle = torch_fsdp.UnshardHandle
if TYPE_CHECKING:  # type-checked against a torch that may predate it
    TorchGradientReductionHandle = object
else:
    TorchGradientReductionHandle = getattr(torch_fsdp, "GradientReductionHandle", object)


def _private_fsdp_common() -> Any:
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_common
    except ImportError:  # pragma: no cover - every supported torch has the module
        return None
    return _fsdp_common


_SHARD_PLACEMENT_RESULT: type | None = getattr(_private_fsdp_common(), "ShardPlacementResult", None)


def placement_result(
    value: object,
) -> tuple[object, Any, int, int | None, Any, Any] | None:
    """(placement, mesh, shard axis, replicate axis, full mesh, dp_mesh_dims) of one.

    For a torch `ShardPlacementResult`, else None; the last two are None unless its mesh
    info was made from a full SPMD mesh with `DataParallelMeshDims` (torch 2.15).
    """
    if _SHARD_PLACEMENT_RESULT is None or not isinstance(value, _SHARD_PLACEMENT_RESULT):
        return None
    info: Any = value.mesh_info  # type: ignore[attr-defined]
    dims = getattr(info, "dp_mesh_dims", None)
    full = getattr(info, "spmd_mesh", None) if dims is not None else None
    placement = value.placement  # type: ignore[attr-defined]
    return placement, info.mesh, info.shard_mesh_dim, info.replicate_mesh_dim, full, dims


def flatten_axes(mesh: Any, names: tuple[str, ...]) -> Any:
    """One mesh axis made of the named axes of `mesh` (in that order)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs `fn` when the backward pass now running finishes (call it from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def in_backward() -> bool:
    """Whether this thread is inside a backward pass (e.g. a checkpointed recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


_SCALARS = (bool, int, float, complex, str, bytes)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`tree` with `fn` applied to every tensor in it, every container keeping its class.

    Containers are what torch's pytree knows (tuples, lists, dicts, namedtuples, OrderedDict,
    and classes libraries register, such as transformers' `ModelOutput`), plus dataclasses and
    dict subclasses it does not know (walked field by field, item by item). Tensors and plain
    tuples, lists and dicts are walked here directly: the hooks call this for every group's
    inputs and outputs, and pytree costs tens of Python calls per walk.
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    cls = type(tree)
    if cls is tuple or cls is list:
        return cls([map_tensors(item, fn) for item in tree])
    if cls is dict:
        return {key: map_tensors(item, fn) for key, item in tree.items()}
    if tree is None or cls in _SCALARS:
        return tree

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {
                f.name: map_tensors(getattr(value, f.name), fn)
                for f in dataclasses.fields(value)
                if f.init
            }
            return dataclasses.replace(value, **changes)
        if isinstance(value, dict):  # a dict subclass pytree does not know
            mapped = copy.copy(value)
            for key, item in value.items():
                mapped[key] = map_tensors(item, fn)
            return mapped
        return value

    return pytree.tree_map(leaf, tree)


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The dict `module` registers its own parameters in (names to parameters), live."""
    slots: dict[str, nn.Parameter | None] = module._parameters
    return slots


class ApplyOverride:
    """Routes `nn.Module._apply` through `self._fsdp_convert(fn, apply)` (see above)."""

    def _fsdp_convert(self, fn: Callable[[torch.Tensor], torch.Tensor], apply: Any) -> Any:
        return apply()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        def apply() -> Any:
            # The next `_apply` in the class's MRO (nn.Module's, or the module class's own),
            # skipping torch's FSDPModule, whose `_apply` works on FSDP2's state.
            mro = type(self).__mro__
            for cls in mro[mro.index(ApplyOverride) + 1 :]:
                if cls is not TorchFSDPModule and "_apply" in vars(cls):
                    return vars(cls)["_apply"](self, fn, recurse)
            raise AssertionError(f"no _apply in {mro}")  # nn.Module always has one

        return self._fsdp_convert(fn, apply)


_NO_RANGE = nullcontext()


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A profiler range named `name` while a profiler runs, else a no-op context."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


def post_accumulate_grad_hooks(
    params: list[nn.Parameter],
) -> list[tuple[nn.Parameter, list[Callable[[nn.Parameter], None]]]]:
    """Each parameter that has post-accumulate-grad hooks, with its hooks in order.

    The dicts are read in C (`map`): this runs on every parameter every backward.
    """
    hook_dicts = list(map(_POST_ACCUMULATE_HOOKS, params))
    return [(p, list(hooks.values())) for p, hooks in zip(params, hook_dicts, strict=True) if hooks]


# A getset descriptor of every tensor: None until a hook is registered.
_POST_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def mark_fsdp_managed(module: nn.Module) -> None:
    """Sets the private marks torch's `fully_shard` puts on every module it manages.

    transformers reads `_is_fsdp_managed_module` (`is_fsdp_managed_module`: `generate` then
    keeps every rank stepping until all are done); dynamo treats those modules' parameters as
    inputs that change between calls.
    """
    for sub in module.modules():
        sub._is_fsdp_managed_module = True  # type: ignore[assignment]
        sub._fsdp_use_orig_params = True  # type: ignore[assignment]


def torch_fsdp_methods() -> list[str]:
    """The names of the methods torch's `FSDPModule` defines (public and private)."""
    skip = {"__dict__", "__doc__", "__module__", "__qualname__", "__weakref__"}
    return sorted(
        name
        for name, value in vars(TorchFSDPModule).items()
        if name not in skip
        and (callable(value) or isinstance(value, staticmethod | classmethod | property))
    )


check_torch_version("fsdp_engine")

# The pipeline-stage shim, a room of its own (imported last: it uses the guard above).
from fsdp_engine._compat._pipeline_state import (  # noqa: E402
    fully_shard_state,
    set_fully_shard_state,
)
