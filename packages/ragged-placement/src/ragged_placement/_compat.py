"""Every touch of a torch internal lives here, behind a version guard.

Private names used by the rest of the package are re-exported from here (DTensorSpec,
TensorMeta, OpSchema, OutputSharding, TorchDispatchMode, the p-norm Partial, process-group
lookups, DTensor construction from a spec), so a torch upgrade is checked in one file.

`install()` wraps these torch entry points so that DTensors with a RaggedShard placement work with
torch's own APIs. Each wrapper checks for a RaggedShard first and otherwise calls the original
unchanged, so DTensors without one behave exactly as before:
- `redistribute_local_tensor`: used by `DTensor.redistribute`, `full_tensor`, `from_local`'s
  and their autograd backward, and op-argument redistribution;
- `distribute_tensor`;
- `DTensor.from_local`: RaggedShard needs the global `shape`; the local piece is checked;
These three are redirected in place (`redirect`), so references bound before the import (by a
user's module or by torch's own) reach the wrapper too. The rest are class attributes, looked up
at each call:
- `to_local()`'s autograd backward, which cannot infer a RaggedShard gradient's stride;
- `DTensor.__create_write_items__` / `__create_chunk_list__` / `__get_tensor_shard__`, through
  which torch.distributed.checkpoint reads and writes a DTensor's chunks;
- `DTensor._stable_hash_for_caching` (where torch has it), torch.compile's on-disk cache key
  of a DTensor input, which must tell one rank's RaggedShard piece from another's;
- `OpDispatcher._propagate_op_sharding_dispatch_slow_path` (called by the C++ DTensor
  dispatcher on a sharding-cache miss) and `ShardingPropagator.propagate` (the Python path);
- `OpDispatcher._dispatch_get_local_results_slow_path`, for random fills (`normal_`,
  `uniform_`, ...: what `nn.init` runs), which torch would offset by a Shard's row offset;
- `torch.distributed._state_dict_utils._distribute_tensors` (redirected), which cuts a full
  state dict's tensors by shape and offset when loading (`set_model_state_dict` with
  `full_state_dict`, `broadcast_from_rank0`);
- `OpDispatcher._custom_op_handlers`, the per-op table the C++ DTensor dispatcher consults
  before anything else: elementwise `_foreach_*` ops get a handler that runs RaggedShard lists
  on their local tensors (`_foreach.py`; torch's fused optimizer kernels too) and hand every
  other call back to the dispatcher with the handler lifted for that call
  (`dispatch_without_handler`). Only list ops get handlers: a handler costs every DTensor
  call of its op a Python round trip (4-7 us measured on `view` and `mean(dim)`);
- `OutputSharding.use_val_from_redistribute_schema` (`rewritten_call`): a rule that gives the
  local call other non-tensor arguments than the global one (a view's local shape).
Supported: torch 2.10 to 2.15 (CI runs the tests on 2.10 and 2.15, `nox -s tests` on every
minor). Where they differ, the choice is made once at import by feature (does the name exist),
not by version compares. Other versions are refused at import with a
clear error rather than risking silent misbehaviour (`check_torch_version`, which dbuffer and
fsdp_engine call too). A torch internal missing at install is an ImportError naming the version.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import math
import operator
import os
import time
import types
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.placement_types import Partial, Placement
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "SUPPORTED_TORCH",
    "DTensorSpec",
    "DispatchMode",
    "OpSchema",
    "OutputSharding",
    "TensorMeta",
    "WeightedMeanPartial",
    "all_gather_single",
    "async_all_gather",
    "async_all_to_all",
    "check_torch_version",
    "current_mesh",
    "dtensor_random_ops",
    "install",
    "local_of",
    "locals_and_specs_of",
    "locals_of",
    "make_dtensor",
    "make_dtensors",
    "norm_partial",
    "process_group_from_op_arg",
    "redirect",
    "spec_of",
    "torch_version",
]

SUPPORTED_TORCH = tuple((2, minor) for minor in range(10, 16))  # 2.10 to 2.15
ALLOW_UNTESTED_TORCH = "RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH"


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def check_torch_version(package: str = "ragged_placement") -> None:
    """Refuses a torch version the packages were not tested on (one guard for all of them).

    Args:
        package: The importing package, named in the error.

    Raises:
        ImportError: Naming the supported versions and the one found, unless the environment
            variable RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH=1 turns the refusal into a warning
            (for trying a new torch; a torch internal that changed still fails at import).

    Example:
        >>> from ragged_placement import check_torch_version
        >>> check_torch_version("my_package")  # on torch 2.10 to 2.15: returns None
    """
    if not isinstance(package, str):
        raise TypeError(f"check_torch_version takes the package name, got {package!r}")
    if torch_version() in SUPPORTED_TORCH:
        return
    (first_major, first_minor), (last_major, last_minor) = SUPPORTED_TORCH[0], SUPPORTED_TORCH[-1]
    supported = f"{first_major}.{first_minor} to {last_major}.{last_minor}"
    message = f"{package} supports torch {supported}; found torch {torch.__version__}"
    if os.environ.get(ALLOW_UNTESTED_TORCH) == "1":
        warnings.warn(f"{message} (allowed by {ALLOW_UNTESTED_TORCH}=1)", stacklevel=2)
        return
    raise ImportError(f"{message}; set {ALLOW_UNTESTED_TORCH}=1 to try it anyway")


# -- private names, re-exported --------------------------------------------------------------


def spec_of(dt: DTensor) -> DTensorSpec:
    """The DTensorSpec of a DTensor."""
    spec: DTensorSpec = dt._spec
    return spec


def local_of(dt: DTensor) -> torch.Tensor:
    """A DTensor's local tensor, without `to_local()`'s autograd node."""
    local: torch.Tensor = dt._local_tensor
    return local


def locals_of(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's local piece (a DTensor's local tensor, a plain tensor itself).

    No Python call per tensor when the list is all DTensors or all plain tensors: a list
    as long as a model's parameters is walked in C.
    """
    kinds = set(map(type, tensors))
    if not any(issubclass(kind, DTensor) for kind in kinds):
        return list(tensors)
    if all(issubclass(kind, DTensor) for kind in kinds):
        return list(map(_LOCAL_TENSOR, tensors))
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


_LOCAL_TENSOR = operator.attrgetter("_local_tensor")


def locals_and_specs_of(dts: Sequence[DTensor]) -> tuple[list[torch.Tensor], list[DTensorSpec]]:
    """`local_of` and `spec_of` of many DTensors (no Python call per DTensor)."""
    return [dt._local_tensor for dt in dts], [dt._spec for dt in dts]


def dtensor_random_ops() -> frozenset[Any]:
    """The ops torch's DTensor dispatcher sends through its Python random path."""
    ops: set[Any] = DTensor._op_dispatcher._random_ops
    return frozenset(ops)


def current_mesh() -> DeviceMesh:
    """The mesh torch uses when a DTensor API gets `device_mesh=None`."""
    mesh: DeviceMesh = dtensor_api._mesh_resources.get_current_mesh()  # type: ignore[attr-defined]
    return mesh


def make_dtensor(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
    """A DTensor from a local tensor and a complete spec (what torch's own APIs do).

    Only `DTensor.__new__` runs: `DTensor.__init__` does nothing but costs a trip through
    dynamo's disable wrapper (~3 us, per parameter per step for the reduced gradients).
    """
    dt: DTensor = DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)
    return dt


def are_we_tracing() -> bool:
    """Whether torch.compile (or another tracer) is tracing this call."""
    return bool(funcol._are_we_tracing())


def dispatch_without_handler(op: Any, args: OpArgs, kwargs: OpKwargs) -> object:
    """`op(*args, **kwargs)` through DTensor's own dispatch, with our handler for `op` lifted."""
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        if handler is not None:
            handlers[op] = handler


def rewritten_call(out: Any, local_call: OpSchema) -> OutputSharding:
    """The output sharding `out`, with the local op called on `local_call`'s arguments.

    DTensor runs an op on the local tensors with the global call's non-tensor arguments
    unless told otherwise; a view of an uneven piece needs that rank's own shape.
    """
    return OutputSharding(
        out,
        redistribute_schema=local_call,
        needs_redistribute=True,
        use_val_from_redistribute_schema=True,
    )


def make_dtensors(locals_: Sequence[torch.Tensor], specs: Sequence[DTensorSpec]) -> list[DTensor]:
    """`make_dtensor` of many (not requiring grad): one constructor call per DTensor."""
    new = DTensor.__new__
    return [new(DTensor, t, s, requires_grad=False) for t, s in zip(locals_, specs, strict=True)]


def process_group_from_op_arg(value: Any) -> dist.ProcessGroup | None:
    """The ProcessGroup behind a collective op's group argument (object or group name)."""
    if value is None:
        return None
    if isinstance(value, dist.ProcessGroup):
        return value
    if isinstance(value, torch.ScriptObject):  # c10d ops carry the group boxed
        group: dist.ProcessGroup = dist.ProcessGroup.unbox(value)
        return group
    resolved: dist.ProcessGroup = _resolve_process_group(value)  # functional ops: a name
    return resolved


# torch 2.13 renamed the tensor collectives (`all_gather_into_tensor` -> `all_gather_single`,
# and funcol's `all_gather_tensor` likewise) and deprecates the old names: the new one where
# it exists, else the old.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def async_all_gather(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather of equal flat pieces that completes lazily (AsyncCollectiveTensor)."""
    out: torch.Tensor = _funcol_all_gather(local, 0, group)
    return out


def async_all_to_all(
    local: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Uneven all-to-all that completes lazily (AsyncCollectiveTensor)."""
    out: torch.Tensor = funcol.all_to_all_single(local, recv, send, group)
    return out


def norm_partial(ord_: float) -> Placement:
    """The Partial placement of a partial vector norm of order `ord_`."""
    if ord_ == math.inf:
        return Partial("max")
    if ord_ == -math.inf:
        return Partial("min")
    if ord_ == 0:
        return Partial("sum")  # the 0-"norm" counts nonzeros
    return _NormPartial(ord_)


class WeightedMeanPartial(Partial):
    """Partial of a mean: each rank holds the mean of its piece and its share of elements."""

    weights: tuple[float, ...]

    def __init__(self, weights: Sequence[float]) -> None:
        super().__init__("sum")
        object.__setattr__(self, "weights", tuple(weights))

    def __eq__(self, other: object) -> bool:
        return type(other) is WeightedMeanPartial and other.weights == self.weights

    def __hash__(self) -> int:
        return hash((WeightedMeanPartial, self.weights))

    def __repr__(self) -> str:
        return f"WeightedMeanPartial({self.weights})"

    def _reduce_value(self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
        weight = self.weights[mesh.get_local_rank(mesh_dim)]
        # An empty piece's mean is NaN; it must contribute nothing, not NaN * 0.
        value = tensor * weight if weight else torch.zeros_like(tensor)
        dist.all_reduce(value, group=mesh.get_group(mesh_dim))
        return value


class DispatchMode(TorchDispatchMode):
    """torch's TorchDispatchMode with typed construction."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]


# -- hooks ---------------------------------------------------------------------------------


OpArgs = tuple[Any, ...]
OpKwargs = dict[str, Any]
OpCall = Callable[[Any, OpArgs, OpKwargs], object]  # op, args, kwargs -> result


class Hooks(Protocol):
    """What `install` calls for RaggedShard inputs (implemented by `_redistribute`, `_ops`)."""

    def is_ragged(self, placements: Sequence[Placement] | None) -> bool: ...
    def schema_is_ragged(self, schema: OpSchema) -> bool: ...
    def redistribute(
        self,
        local: torch.Tensor,
        current: DTensorSpec,
        target: DTensorSpec,
        original: Callable[..., torch.Tensor],
        async_op: bool,
    ) -> torch.Tensor: ...
    def distribute(
        self,
        tensor: torch.Tensor,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        original: Callable[..., DTensor],
        src_data_rank: int | None,
    ) -> DTensor: ...
    def check_from_local(
        self,
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: torch.Size,
    ) -> None: ...
    def propagate(
        self, schema: OpSchema, tensor_meta: Callable[[OpSchema], Any], *, cacheable: bool
    ) -> OutputSharding: ...
    def checkpoint_write_items(self, dt: DTensor, fqn: str) -> list[Any]: ...
    def checkpoint_chunks(self, dt: DTensor) -> list[Any]: ...
    def checkpoint_shard(self, dt: DTensor, index: Any) -> torch.Tensor: ...
    def random_fill(
        self, op: Any, dt: DTensor, args: Sequence[object], kwargs: dict[str, Any]
    ) -> torch.Tensor | None: ...
    def load_full(self, dt: DTensor, full: torch.Tensor) -> DTensor: ...
    def foreach_ops(self) -> list[Any]: ...
    def run_foreach(self, op: Any, args: OpArgs, kwargs: OpKwargs, fallback: OpCall) -> object: ...


_installed: list[Hooks] = []


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of `shape`."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def redirect(
    function: Callable[..., Any], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Makes `function` run `wrap(original)`, through every reference anyone holds to it.

    Rebinding a module attribute misses the references taken before: a user's
    `from torch.distributed.tensor import distribute_tensor` made before this package was
    imported, and torch's own modules that import the name (`_api` and `_dispatch` both bind
    `redistribute_local_tensor`). Instead `function` keeps its identity and gets new code: a
    call with its exact signature into the wrapper, which receives an intact copy of the
    original. The wrapper is stored in the function's module under a private name, since the
    new code looks it up in the function's globals.

    Args:
        function: A plain module-level function (no closure) of torch.
        wrap: Builds the replacement from a copy of the original.
    """
    if not isinstance(function, types.FunctionType) or function.__closure__:
        raise _torch_changed(f"{function!r} is no longer a plain function")
    original = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    original.__kwdefaults__ = function.__kwdefaults__
    original.__qualname__ = function.__qualname__
    original.__doc__ = function.__doc__
    replacement = functools.wraps(original)(wrap(original))
    slot = f"_ragged_placement_{function.__name__}"
    function.__globals__[slot] = replacement
    function.__code__ = _forwarding_code(function, slot)
    function.__wrapped__ = original  # type: ignore[attr-defined]


def _forwarding_code(function: types.FunctionType, slot: str) -> types.CodeType:
    """Code with `function`'s parameters that returns `slot(<the same arguments>)`."""
    params: list[str] = []
    args: list[str] = []
    star_written = False
    signature = list(inspect.signature(function).parameters.values())
    for index, param in enumerate(signature):
        # The defaults stay in the function object; the new code only needs the same shape.
        default = "=None" if param.default is not param.empty else ""
        if param.kind is param.VAR_POSITIONAL:
            params.append(f"*{param.name}")
            args.append(f"*{param.name}")
            star_written = True
        elif param.kind is param.VAR_KEYWORD:
            params.append(f"**{param.name}")
            args.append(f"**{param.name}")
        elif param.kind is param.KEYWORD_ONLY:
            if not star_written:
                params.append("*")
                star_written = True
            params.append(param.name + default)
            args.append(f"{param.name}={param.name}")
        else:
            params.append(param.name + default)
            args.append(param.name)
            following = signature[index + 1] if index + 1 < len(signature) else None
            if param.kind is param.POSITIONAL_ONLY and (
                following is None or following.kind is not param.POSITIONAL_ONLY
            ):
                params.append("/")
    name = function.__name__
    source = f"def {name}({', '.join(params)}):\n    return {slot}({', '.join(args)})\n"
    namespace: dict[str, Any] = {}
    exec(source, {}, namespace)
    code: types.CodeType = namespace[function.__name__].__code__
    return code.replace(co_filename=f"<ragged_placement forwarding {function.__qualname__}>")


def _function_of(cls: type, name: str) -> Callable[..., Any]:
    """The plain function behind `cls.name` (unwrapping a staticmethod)."""
    attribute = cls.__dict__.get(name)
    function = getattr(attribute, "__func__", attribute)
    if function is None:
        raise _torch_changed(f"{cls.__qualname__}.{name} is missing")
    return function  # type: ignore[no-any-return]


def _torch_changed(what: str) -> ImportError:
    return ImportError(
        f"ragged_placement cannot install its DTensor hooks on torch {torch.__version__}: {what}"
    )


def _let_gloo_release_work() -> None:
    """At exit, gives gloo's worker threads a moment to drop the collectives they finished.

    A gloo worker thread releases a finished collective's work object some time after
    `wait()` has returned, and with it maybe the last reference to a tensor that Python made
    (the pieces RaggedShard broadcasts into, a reduce-dtype temporary); freeing that tensor
    takes the GIL. If the interpreter is already shutting down by then, the thread dies while
    it unwinds: "terminate called without an active exception", SIGABRT, at the end of a
    program that did all its work (seen here in a third to a half of 3-rank runs on 2 cores).
    Exit handlers run while threads may still take the GIL; sleeping releases it.
    """
    if _gloo_threads_alive():
        time.sleep(0.1)


# torch 2.10's gloo leaves its worker threads unnamed (they inherit "python"), so nothing
# tells them from other threads there: the exit handler then always waits (0.1 s). The one
# version compare in this module, since only a running gloo group could show the feature.
_GLOO_NAMES_ITS_THREADS = torch_version() >= (2, 11)


def _gloo_threads_alive() -> bool:
    if dist.is_available() and dist.is_initialized():
        return True  # a live process group may own worker threads
    if not _GLOO_NAMES_ITS_THREADS:
        return dist.is_available()
    try:
        names = [task.joinpath("comm").read_text() for task in Path("/proc/self/task").iterdir()]
    except OSError:  # not Linux: assume they may be
        return dist.is_available()
    return any(name.startswith("pt_gloo_runloop") for name in names)


def install(hooks: Hooks) -> None:
    """Wraps torch's DTensor entry points once (see the module docstring)."""
    if _installed:
        return
    check_torch_version()
    _installed.append(hooks)
    atexit.register(_let_gloo_release_work)
    try:
        _install(hooks)
    except AttributeError as exc:  # a torch internal this version no longer has
        raise _torch_changed(str(exc)) from exc


def _install(hooks: Hooks) -> None:

    def wrap_redistribute(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def redistribute_local_tensor(
            local: torch.Tensor,
            current: DTensorSpec,
            target: DTensorSpec,
            *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:
            if hooks.is_ragged(current.placements) or hooks.is_ragged(target.placements):
                async_op = bool(kwargs.get("async_op", False))
                return hooks.redistribute(local, current, target, original, async_op)
            return original(local, current, target, *args, **kwargs)

        return redistribute_local_tensor

    def wrap_distribute(original: Callable[..., DTensor]) -> Callable[..., DTensor]:
        def distribute_tensor(
            tensor: torch.Tensor,
            device_mesh: DeviceMesh | None = None,
            placements: Sequence[Placement] | None = None,
            *,
            src_data_rank: int | None = 0,
        ) -> DTensor:
            if placements is not None and hooks.is_ragged(placements):
                mesh = device_mesh or current_mesh()
                return hooks.distribute(tensor, mesh, placements, original, src_data_rank)
            return original(tensor, device_mesh, placements, src_data_rank=src_data_rank)

        return distribute_tensor

    def wrap_from_local(original: Callable[..., DTensor]) -> Callable[..., DTensor]:
        def from_local(
            local_tensor: torch.Tensor,
            device_mesh: DeviceMesh | None = None,
            placements: Sequence[Placement] | None = None,
            **kwargs: Any,
        ) -> DTensor:
            if placements is not None and hooks.is_ragged(placements):
                if kwargs.get("shape") is None:
                    raise ValueError(
                        "DTensor.from_local with a RaggedShard placement needs shape= (the "
                        "global shape): a ragged piece does not determine it"
                    )
                shape = torch.Size(kwargs["shape"])
                kwargs["shape"] = shape
                if kwargs.get("stride") is None:
                    kwargs["stride"] = contiguous_strides(shape)
                mesh = device_mesh or current_mesh()
                hooks.check_from_local(local_tensor, mesh, placements, shape)
            return original(local_tensor, device_mesh, placements, **kwargs)

        return from_local

    # Redirected (not rebound): every reference taken before this import reaches the wrapper.
    redirect(dtensor_redistribute.redistribute_local_tensor, wrap_redistribute)
    redirect(dtensor_api.distribute_tensor, wrap_distribute)
    redirect(_function_of(DTensor, "from_local"), wrap_from_local)

    # The hooks cache their decisions (`_decisions.py`): every call that reaches Python (foreach
    # ops whose C++ cache key cannot be computed; torch versions without the C++ cache) would
    # otherwise run fake-tensor propagation again, ~0.1 ms per op.
    def ragged_sharding(propagator: ShardingPropagator, schema: OpSchema) -> OutputSharding:
        return hooks.propagate(
            schema,
            propagator._propagate_tensor_meta_non_cached,
            cacheable=not funcol._are_we_tracing(),  # symbolic shapes do not hash
        )

    dispatcher = dtensor_dispatch.OpDispatcher
    original_slow_path = dispatcher._propagate_op_sharding_dispatch_slow_path

    @functools.wraps(original_slow_path)
    def slow_path(
        self: Any, op_call: Any, args: Any, kwargs: Any, op_info: Any, *rest: Any
    ) -> object:
        if op_info.schema is not None and hooks.schema_is_ragged(op_info.schema):
            return ragged_sharding(self.sharding_propagator, op_info.schema)
        return original_slow_path(self, op_call, args, kwargs, op_info, *rest)

    setattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path", slow_path)  # noqa: B010

    # to_local()'s backward infers the global stride from placements torch knows; a RaggedShard
    # gradient keeps the forward spec instead (the placements of the input, contiguous).
    to_torch = dtensor_api._ToTorchTensor
    original_to_local_backward = to_torch.backward

    @functools.wraps(original_to_local_backward)
    def to_local_backward(ctx: Any, grad_output: torch.Tensor | None) -> Any:
        spec = ctx.dtensor_spec
        if grad_output is None or not hooks.is_ragged(spec.placements):
            return original_to_local_backward(ctx, grad_output)
        placements = ctx.grad_placements or spec.placements
        grad = DTensor.from_local(
            grad_output, spec.mesh, placements, shape=spec.shape, stride=spec.stride
        )
        return grad, None

    setattr(to_torch, "backward", staticmethod(to_local_backward))  # noqa: B010

    # torch.distributed.checkpoint asks a DTensor for its chunks through these dunders.
    original_write_items = DTensor.__create_write_items__
    original_chunk_list = DTensor.__create_chunk_list__
    original_tensor_shard = DTensor.__get_tensor_shard__

    @functools.wraps(original_write_items)
    def create_write_items(self: DTensor, fqn: str, obj: Any) -> Any:
        if hooks.is_ragged(self.placements):
            return hooks.checkpoint_write_items(self, fqn)
        return original_write_items(self, fqn, obj)

    @functools.wraps(original_chunk_list)
    def create_chunk_list(self: DTensor) -> Any:
        if hooks.is_ragged(self.placements):
            return hooks.checkpoint_chunks(self)
        return original_chunk_list(self)  # type: ignore[no-untyped-call]

    @functools.wraps(original_tensor_shard)
    def get_tensor_shard(self: DTensor, index: Any) -> Any:
        if hooks.is_ragged(self.placements):
            return hooks.checkpoint_shard(self, index)
        return original_tensor_shard(self, index)  # type: ignore[no-untyped-call]

    setattr(DTensor, "__create_write_items__", create_write_items)  # noqa: B010
    setattr(DTensor, "__create_chunk_list__", create_chunk_list)  # noqa: B010
    setattr(DTensor, "__get_tensor_shard__", get_tensor_shard)  # noqa: B010

    # torch.compile's on-disk AOTAutograd cache keys a DTensor input by its spec (global
    # shape, placements, mesh) and device, not by its local piece. Ranks share one cache
    # directory by default and, on CPU, one device: a rank would load code compiled for
    # another rank's RaggedShard piece of another shape (wrong-size asserts, crashes, or
    # silently wrong results). The piece's shape and stride join the key.
    original_cache_hash = getattr(DTensor, "_stable_hash_for_caching", None)
    if original_cache_hash is not None:

        @functools.wraps(original_cache_hash)
        def stable_hash_for_caching(self: DTensor) -> str:
            key: str = original_cache_hash(self)
            if not hooks.is_ragged(self.placements):
                return key
            local = self._local_tensor
            return f"{key}/{tuple(local.shape)}/{tuple(local.stride())}"

        setattr(DTensor, "_stable_hash_for_caching", stable_hash_for_caching)  # noqa: B010

    original_propagate = ShardingPropagator.propagate

    @functools.wraps(original_propagate)
    def propagate(self: ShardingPropagator, op_info: Any) -> None:
        if op_info.schema is not None and hooks.schema_is_ragged(op_info.schema):
            op_info.output_sharding = ragged_sharding(self, op_info.schema)
            return
        original_propagate(self, op_info)

    setattr(ShardingPropagator, "propagate", propagate)  # noqa: B010

    # Random fills (nn.init on sharded parameters, e.g. after meta init and to_empty) reach
    # Python here: torch's own would offset a shared generator by a Shard's row offset, which
    # a RaggedShard piece does not have.
    original_local_results = dispatcher._dispatch_get_local_results_slow_path

    @functools.wraps(original_local_results)
    def local_results(self: Any, op_call: Any, args: Any, op_info: Any, *rest: Any) -> object:
        first = args[0] if args else None
        if isinstance(first, DTensor) and hooks.is_ragged(first._spec.placements):
            filled = hooks.random_fill(op_call, first, args[1:], dict(op_info.local_kwargs))
            if filled is not None:
                return filled
        return original_local_results(self, op_call, args, op_info, *rest)

    setattr(dispatcher, "_dispatch_get_local_results_slow_path", local_results)  # noqa: B010

    # Loading a full state dict into DTensors (set_model_state_dict with full_state_dict, and
    # broadcast_from_rank0) cuts each full tensor by a shape and offset, which a RaggedShard
    # piece does not have: those entries are cut by the hooks, the rest by torch.
    def wrap_distribute_tensors(original: Callable[..., None]) -> Callable[..., None]:
        def _distribute_tensors(
            local_state_dict: dict[str, Any],
            keys: list[str],
            device: torch.device,
            pg: dist.ProcessGroup | None = None,
        ) -> None:
            rest = []
            for key in keys:
                entry = local_state_dict.get(key)
                if (
                    isinstance(entry, list | tuple)
                    and len(entry) == 2
                    and isinstance(entry[0], DTensor)
                    and hooks.is_ragged(entry[0].placements)
                ):
                    local_state_dict[key] = hooks.load_full(entry[0], entry[1])
                else:
                    rest.append(key)
            original(local_state_dict, rest, device, pg)

        return _distribute_tensors

    redirect(state_dict_utils._distribute_tensors, wrap_distribute_tensors)

    # Elementwise foreach ops (an optimizer step's): one handler each, unless torch has one.
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers

    def run_foreach(op: Any, args: OpArgs, kwargs: OpKwargs) -> object:
        return hooks.run_foreach(op, args, kwargs, dispatch_without_handler)

    for op in hooks.foreach_ops():
        handlers.setdefault(op, run_foreach)
