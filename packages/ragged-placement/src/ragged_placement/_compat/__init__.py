"""Every touch of a torch internal lives in this folder, behind a version guard.

This module holds the guard and re-exports the private names the rest of the package uses
(DTensorSpec, TensorMeta, OpSchema, OutputSharding, TorchDispatchMode, the p-norm Partial,
process-group lookups, DTensor construction from a spec), so a torch upgrade is checked here.
`_patches.py` is the patch engine (one function per patched entry point, below);
`_gloo_exit.py` an exit handler that lets gloo's worker threads finish (not a patch).

The names it hands the rest of the package (`__all__`):
- `SUPPORTED_TORCH`, `torch_version`, `check_torch_version`: the version guard (below);
- `DTensorSpec`, `TensorMeta`, `OpSchema`, `OutputSharding`, `OpOverload`, `DispatchMode`:
  torch's private DTensor and dispatch types, re-exported as they are (typed where needed);
- `spec_of`, `specs_of`, `local_of`, `locals_of`, `dtensor_locals`, `locals_and_specs_of`: a
  DTensor's `_spec` and `_local_tensor` read directly (without `to_local()`'s autograd node),
  for one DTensor or mapped over a list in C;
- `make_dtensor`, `make_dtensors`: DTensors from local tensors and complete specs through
  `DTensor.__new__` alone (what torch's own APIs do);
- `op_arguments`, `dtensor_random_ops`, `current_mesh`, `process_group_from_op_arg`: an op's
  schema arguments, the dispatcher's random ops, the current mesh, a collective's group;
- `norm_partial`, `WeightedMeanPartial`: the Partial placements of a vector norm (torch's
  private `_NormPartial`) and of a mean over uneven pieces;
- `all_gather_single`, `async_all_gather`, `async_all_to_all`: the tensor collectives under
  their 2.13 names where torch has them, and the functional (lazily waited) ones;
- `are_we_tracing`, `dispatch_without_handler`, `rewritten_call`, `contiguous_strides`:
  whether torch.compile traces, an op through DTensor's dispatch with our handler lifted, an
  output sharding whose local call takes other arguments, and row-major strides;
- `install`, `redirect`: the patch engine (`_patches.py`).

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
- `DTensor.__reduce_ex__` / `__deepcopy__` (`_pickle.py`): a DTensor over a piece of a larger
  storage (every DBuffer view after the first) pickles, deep-copies and `torch.save`s as a
  DTensor over a copy of its piece; torch's own path fails on it since 2.11.
Supported: torch 2.10 to 2.15 (CI runs the tests on 2.10 and 2.15, `nox -s tests` on every
minor). Where they differ, the choice is made once at import by feature (does the name exist),
not by version compares. Other versions are refused at import with a
clear error rather than risking silent misbehaviour (`check_torch_version`, which dbuffer and
fsdp_engine call too). A torch internal missing at install is an ImportError naming the version.
"""

from __future__ import annotations

import math
import operator
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.tensor._api as dtensor_api
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Partial, Placement
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "SUPPORTED_TORCH",
    "DTensorSpec",
    "DispatchMode",
    "OpOverload",
    "OpSchema",
    "OutputSharding",
    "TensorMeta",
    "WeightedMeanPartial",
    "all_gather_single",
    "are_we_tracing",
    "async_all_gather",
    "async_all_to_all",
    "check_torch_version",
    "contiguous_strides",
    "current_mesh",
    "dispatch_without_handler",
    "dtensor_locals",
    "dtensor_random_ops",
    "install",
    "local_of",
    "locals_and_specs_of",
    "locals_of",
    "make_dtensor",
    "make_dtensors",
    "norm_partial",
    "op_arguments",
    "process_group_from_op_arg",
    "redirect",
    "rewritten_call",
    "spec_of",
    "specs_of",
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


OpArgs = tuple[Any, ...]
OpKwargs = dict[str, Any]
OpCall = Callable[[Any, OpArgs, OpKwargs], object]  # op, args, kwargs -> result


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


_SPEC = operator.attrgetter("_spec")


def specs_of(dts: Sequence[DTensor]) -> list[DTensorSpec]:
    """`spec_of` of many DTensors (walked in C)."""
    return list(map(_SPEC, dts))


def dtensor_locals(dts: Sequence[DTensor]) -> list[torch.Tensor]:
    """`local_of` of many DTensors (walked in C; every entry must be a DTensor)."""
    return list(map(_LOCAL_TENSOR, dts))


OpOverload = torch._ops.OpOverload


def op_arguments(op: OpOverload) -> list[Any]:
    """An op overload's schema arguments (each with `name`, `type`, `alias_info`)."""
    return list(op._schema.arguments)


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


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of `shape`."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


# The patch engine and the gloo exit workaround, each in its own module (imported last:
# they use the names above).
from ragged_placement._compat._patches import Hooks, _installed, install, redirect  # noqa: E402, F401
