"""Every touch of a torch internal lives here, behind a version guard.

Private names used by the rest of the package are re-exported from here (DTensorSpec,
TensorMeta, OpSchema, OutputSharding, TorchDispatchMode, the p-norm Partial, process-group
lookups, DTensor construction from a spec), so a torch upgrade is checked in one file.

`install()` wraps these torch entry points so that DTensors with a RaggedShard placement work with
torch's own APIs. Each wrapper checks for a RaggedShard first and otherwise calls the original
unchanged, so DTensors without one behave exactly as before:
- `_redistribute.redistribute_local_tensor` (also bound in `_dispatch`): used by
  `DTensor.redistribute`, `full_tensor`, their autograd backward and op-argument
  redistribution;
- `distribute_tensor` (in `torch.distributed.tensor` and its `_api` module);
- `DTensor.from_local`: RaggedShard needs the global `shape`; the local piece is checked;
- `to_local()`'s autograd backward, which cannot infer a RaggedShard gradient's stride;
- `DTensor.__create_write_items__` / `__create_chunk_list__` / `__get_tensor_shard__`, through
  which torch.distributed.checkpoint reads and writes a DTensor's chunks;
- `OpDispatcher._propagate_op_sharding_dispatch_slow_path` (called by the C++ DTensor
  dispatcher on a sharding-cache miss) and `ShardingPropagator.propagate` (the Python path).
Tested on torch 2.13 and 2.14 (`nox -s tests`); other versions are refused at import with a
clear error rather than risking silent misbehaviour.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.tensor as dtensor_pkg
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
    "DTensorSpec",
    "DispatchMode",
    "OpSchema",
    "OutputSharding",
    "TensorMeta",
    "WeightedMeanPartial",
    "async_all_gather",
    "async_all_to_all",
    "current_mesh",
    "install",
    "make_dtensor",
    "norm_partial",
    "process_group_from_op_arg",
    "spec_of",
]

SUPPORTED_TORCH = ((2, 13), (2, 14))


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    """Raises ImportError on a torch version the hooks were not tested on."""
    if torch_version() not in SUPPORTED_TORCH:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
        raise ImportError(
            f"ragged_placement supports torch {supported}; found torch {torch.__version__}"
        )


# -- private names, re-exported --------------------------------------------------------------


def spec_of(dt: DTensor) -> DTensorSpec:
    """The DTensorSpec of a DTensor."""
    spec: DTensorSpec = dt._spec
    return spec


def current_mesh() -> DeviceMesh:
    """The mesh torch uses when a DTensor API gets `device_mesh=None`."""
    mesh: DeviceMesh = dtensor_api._mesh_resources.get_current_mesh()  # type: ignore[attr-defined]
    return mesh


def make_dtensor(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
    """A DTensor from a local tensor and a complete spec (what torch's own APIs do)."""
    return DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]


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


def async_all_gather(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather of equal flat pieces that completes lazily (AsyncCollectiveTensor)."""
    out: torch.Tensor = funcol.all_gather_single(local, 0, group)
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
        self, schema: OpSchema, tensor_meta: Callable[[OpSchema], Any]
    ) -> OutputSharding: ...
    def checkpoint_write_items(self, dt: DTensor, fqn: str) -> list[Any]: ...
    def checkpoint_chunks(self, dt: DTensor) -> list[Any]: ...
    def checkpoint_shard(self, dt: DTensor, index: Any) -> torch.Tensor: ...


_installed: list[Hooks] = []


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of `shape`."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def install(hooks: Hooks) -> None:
    """Wraps torch's DTensor entry points once (see the module docstring)."""
    if _installed:
        return
    check_torch_version()
    _installed.append(hooks)

    original_redistribute = dtensor_redistribute.redistribute_local_tensor

    @functools.wraps(original_redistribute)
    def redistribute_local_tensor(
        local: torch.Tensor, current: DTensorSpec, target: DTensorSpec, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if hooks.is_ragged(current.placements) or hooks.is_ragged(target.placements):
            async_op = bool(kwargs.get("async_op", False))
            return hooks.redistribute(local, current, target, original_redistribute, async_op)
        result: torch.Tensor = original_redistribute(local, current, target, *args, **kwargs)
        return result

    setattr(dtensor_redistribute, "redistribute_local_tensor", redistribute_local_tensor)  # noqa: B010
    if hasattr(dtensor_dispatch, "redistribute_local_tensor"):
        setattr(dtensor_dispatch, "redistribute_local_tensor", redistribute_local_tensor)  # noqa: B010

    original_distribute = dtensor_api.distribute_tensor

    @functools.wraps(original_distribute)
    def distribute_tensor(
        tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        src_data_rank: int | None = 0,
    ) -> DTensor:
        if placements is not None and hooks.is_ragged(placements):
            mesh = device_mesh or current_mesh()
            return hooks.distribute(tensor, mesh, placements, original_distribute, src_data_rank)
        return original_distribute(tensor, device_mesh, placements, src_data_rank=src_data_rank)

    dtensor_api.distribute_tensor = distribute_tensor
    dtensor_pkg.distribute_tensor = distribute_tensor

    original_from_local = DTensor.from_local

    @functools.wraps(original_from_local)
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        **kwargs: Any,
    ) -> DTensor:
        if placements is not None and hooks.is_ragged(placements):
            if kwargs.get("shape") is None:
                raise ValueError(
                    "DTensor.from_local with a RaggedShard placement needs shape= (the global "
                    "shape): a ragged piece does not determine it"
                )
            shape = torch.Size(kwargs["shape"])
            kwargs["shape"] = shape
            if kwargs.get("stride") is None:
                kwargs["stride"] = contiguous_strides(shape)
            hooks.check_from_local(local_tensor, device_mesh or current_mesh(), placements, shape)
        return original_from_local(local_tensor, device_mesh, placements, **kwargs)

    DTensor.from_local = staticmethod(from_local)  # type: ignore[method-assign]

    dispatcher = dtensor_dispatch.OpDispatcher
    original_slow_path = dispatcher._propagate_op_sharding_dispatch_slow_path

    @functools.wraps(original_slow_path)
    def slow_path(
        self: Any, op_call: Any, args: Any, kwargs: Any, op_info: Any, *rest: Any
    ) -> object:
        if op_info.schema is not None and hooks.schema_is_ragged(op_info.schema):
            propagator = self.sharding_propagator
            return hooks.propagate(op_info.schema, propagator._propagate_tensor_meta_non_cached)
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

    original_propagate = ShardingPropagator.propagate

    @functools.wraps(original_propagate)
    def propagate(self: ShardingPropagator, op_info: Any) -> None:
        if op_info.schema is not None and hooks.schema_is_ragged(op_info.schema):
            op_info.output_sharding = hooks.propagate(
                op_info.schema, self._propagate_tensor_meta_non_cached
            )
            return
        original_propagate(self, op_info)

    setattr(ShardingPropagator, "propagate", propagate)  # noqa: B010
