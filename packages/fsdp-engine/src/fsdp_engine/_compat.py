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
- `set_fully_shard_state(module, ...)` / `fully_shard_state(module)`: what torch's
  `fully_shard.state(module)` returns (the private registry of torch's composable APIs), and
  that lookup by torch's own function, even after a user rebinds
  `torch.distributed.fsdp.fully_shard` to ours. torch 2.10-2.15.0's pipeline stages call it
  on an FSDPModule to run its post-backward at the end of a schedule.
- `placement_result(value)`: reads torch's `ShardPlacementResult` (torch 2.13+, a private
  dataclass of `_fully_shard._fsdp_common` that `shard_placement_fn` may return to put one
  parameter on its own mesh: experts beside expert parallelism) into (placement, mesh,
  shard axis, replicate axis, and its full SPMD mesh and `DataParallelMeshDims` where
  torch 2.15 made it from those); None for anything else.
- `norm_keys(tensors)`: reads each DTensor's `_spec` (mesh and placements) directly: the
  public `device_mesh` / `placements` are Python properties, and `clip_grad_norm_` asks
  every gradient every step. It remembers each spec's key by the spec's identity (a
  DBuffer hands out the same spec objects every step).
- `mark_fsdp_managed(module)`: the private marks torch's `fully_shard` sets on the modules
  it manages (`_is_fsdp_managed_module`, `_fsdp_use_orig_params`), which transformers and
  dynamo read.
- `flatten_axes(mesh, names)`: `DeviceMesh._flatten`, the one way to make one axis of several
  named ones (`DataParallelMeshDims(shard=("dp_shard", "cp"))`).
- `all_gather_single`: torch.distributed's name since 2.13; before, the same collective is
  `all_gather_into_tensor` (chosen once, by which name exists).
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from ragged_placement import check_torch_version

__all__ = [
    "ApplyOverride",
    "TorchFSDPModule",
    "TorchGradientReductionHandle",
    "TorchUnshardHandle",
    "all_gather_single",
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


class _KeyProbe(dict[Any, Any]):
    """Records the key `fully_shard.state` looks a module's state up by."""

    key: Any = None

    def get(self, key: Any, default: Any = None) -> Any:
        self.key = key
        return default


def _torch_fully_shard() -> Any:
    # From its defining module: a user may have rebound `torch.distributed.fsdp.fully_shard`
    # to ours (the drop-in swap), and the registry belongs to torch's function.
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard

    return fully_shard


@functools.cache
def _fully_shard_state_key() -> Any:
    from torch.distributed._composable.contract import STATE_KEY

    module = nn.Module()
    probe = _KeyProbe()
    module.__dict__[STATE_KEY] = probe
    _torch_fully_shard().state(module)
    return STATE_KEY, probe.key


def fully_shard_state(module: nn.Module) -> Any:
    """`torch.distributed.fsdp.fully_shard.state(module)`, looked up by torch's own function."""
    return _torch_fully_shard().state(module)


class _GroupView:
    """One FSDP state as torch's pipeline stage sees it: `._fsdp_param_group(s)`."""

    def __init__(self, post_backward: Callable[[], None] | None) -> None:
        self._post_backward = post_backward
        self._fsdp_param_group = self if post_backward is not None else None  # torch 2.10
        self._fsdp_param_groups = [self] if post_backward is not None else []  # 2.11-2.14

    def post_backward(self) -> None:
        assert self._post_backward is not None
        self._post_backward()


class _StateView:
    """`fully_shard.state(root)` as torch 2.10-2.15.0's pipeline stages use it."""

    def __init__(
        self,
        post_backwards: Callable[[], list[Callable[[], None] | None]],
        final_callback: Callable[[], None],
    ) -> None:
        self._post_backwards = post_backwards
        self._root_post_backward_final_callback = final_callback

    @property
    def _state_ctx(self) -> SimpleNamespace:
        # torch's FSDPStateContext, of which the stage reads `all_states` only.
        return SimpleNamespace(all_states=[_GroupView(fn) for fn in self._post_backwards()])


def set_fully_shard_state(
    module: nn.Module,
    post_backwards: Callable[[], list[Callable[[], None] | None]],
    final_callback: Callable[[], None],
) -> None:
    """Makes `torch.distributed.fsdp.fully_shard.state(module)` drive ours.

    Args:
        module: A module fully_shard applied to.
        post_backwards: Returns, for every FSDP state under the module's root, its
            post-backward (None for a state without parameters).
        final_callback: What runs at the end of backward (wait for the reduces, hand out
            the gradients, reset the iteration).
    """
    state_key, key = _fully_shard_state_key()
    module.__dict__.setdefault(state_key, {})[key] = _StateView(post_backwards, final_callback)


check_torch_version("fsdp_engine")


NormKey = tuple[object, tuple[int, ...]]  # (mesh or device, the mesh axes that shard)

_SPEC = operator.attrgetter("_spec")
_MESH = operator.attrgetter("mesh")
_PLACEMENTS = operator.attrgetter("placements")
_HELD, _KEY = operator.itemgetter(0), operator.itemgetter(1)
# A gradient's spec is its buffer's, the same object every step: its key is remembered by the
# spec's identity (the spec is held, so its id is not reused), and keys are interned (one
# object per mesh and placement kinds, what is held keeps its id). Bounded: both are dropped
# together when many specs were seen (models built and dropped).
_KEY_OF_SPEC: dict[int, tuple[object, NormKey]] = {}
_INTERNED: dict[tuple[object, tuple[type, ...]], NormKey] = {}
_MAX_SPECS = 1 << 16


def norm_keys(tensors: Sequence[torch.Tensor]) -> list[NormKey]:
    """Per tensor: (its mesh, the mesh axes that shard it) for a DTensor, (device, ()) else.

    Equal keys are the same object (for one mesh object and one set of placement kinds), so
    keys compare and group by identity; DTensors seen before cost no Python call each.

    Example:
        >>> norm_keys([torch.zeros(2)])
        [(device(type='cpu'), ())]
    """
    if not tensors or set(map(type, tensors)) != {DTensor}:
        # A device is a new object per tensor: keyed by value (a mesh by identity).
        specs = [getattr(tensor, "_spec", None) for tensor in tensors]
        wheres = [t.device if s is None else s.mesh for t, s in zip(tensors, specs, strict=True)]
        pairs = [
            (where, ()) if spec is None else (id(where), tuple(map(type, spec.placements)))
            for where, spec in zip(wheres, specs, strict=True)
        ]
        return _interned(pairs, wheres)
    specs = list(map(_SPEC, tensors))
    known = list(map(_KEY_OF_SPEC.get, map(id, specs)))
    if None not in known and all(map(operator.is_, map(_HELD, known), specs)):  # type: ignore[arg-type]
        return list(map(_KEY, known))  # type: ignore[arg-type]
    if len(_KEY_OF_SPEC) > _MAX_SPECS:
        _KEY_OF_SPEC.clear()
        _INTERNED.clear()
    meshes = list(map(_MESH, specs))
    placements = list(map(_PLACEMENTS, specs))
    ndims = set(map(len, placements))
    if len(ndims) == 1:  # the placement kinds axis by axis, in C
        axes = range(ndims.pop())
        columns = (map(type, map(operator.itemgetter(a), placements)) for a in axes)
        kinds = list(zip(*columns, strict=True))
    else:
        kinds = list(map(tuple, map(map, itertools.repeat(type), placements)))
    keys = _interned(list(zip(map(id, meshes), kinds, strict=True)), meshes)
    _KEY_OF_SPEC.update(zip(map(id, specs), zip(specs, keys, strict=True), strict=True))
    return keys


def _interned(
    pairs: Sequence[tuple[object, tuple[type, ...]]], wheres: Sequence[Any]
) -> list[NormKey]:
    """The interned key of each (mesh id or device, placement kinds) pair."""
    for pair, where in dict(zip(pairs, wheres, strict=True)).items():
        if pair not in _INTERNED:
            kinds = pair[1]
            axes = tuple(i for i, kind in enumerate(kinds) if not issubclass(kind, Replicate))
            key = _INTERNED[pair] = (where, axes)
            if any(issubclass(kind, Partial) for kind in kinds):
                _PARTIAL_KEYS[id(key)] = key
    return list(map(_INTERNED.__getitem__, pairs))


_PARTIAL_KEYS: dict[int, NormKey] = {}  # keys of DTensors with a Partial axis (pending sums)


def is_partial_key(key: NormKey) -> bool:
    """Whether a `norm_keys` key is that of a DTensor with a Partial placement.

    Example:
        >>> is_partial_key(norm_keys([torch.zeros(2)])[0])
        False
    """
    return _PARTIAL_KEYS.get(id(key)) is key
