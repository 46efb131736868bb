"""The patch engine: torch's DTensor entry points, wrapped so that RaggedShard works through them.

`install(hooks)` wraps each entry point once (one function here per entry point; the list and
why each is needed are in `_compat`'s docstring). Each wrapper checks for a RaggedShard first
and otherwise calls the original unchanged, so DTensors without one behave exactly as before.
Module-level functions that other modules bound before this import are redirected in place
(`redirect`); class attributes are replaced, since they are looked up at each call.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.placement_types import Placement

from ragged_placement._compat import (
    DTensorSpec,
    OpArgs,
    OpCall,
    OpKwargs,
    check_torch_version,
    contiguous_strides,
    current_mesh,
    dispatch_without_handler,
)
from ragged_placement._compat._gloo_exit import let_gloo_release_work
from ragged_placement._compat._pickle import patch_pickling


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


def install(hooks: Hooks) -> None:
    """Wraps torch's DTensor entry points once (see `_compat`'s docstring)."""
    if _installed:
        return
    check_torch_version()
    _installed.append(hooks)
    atexit.register(let_gloo_release_work)
    try:
        for patch in _PATCHES:
            patch(hooks)
    except AttributeError as exc:  # a torch internal this version no longer has
        raise _torch_changed(str(exc)) from exc


def _patch_redistribute(hooks: Hooks) -> None:
    """`redistribute_local_tensor`: `redistribute`, `full_tensor`, op-argument moves."""

    def wrap(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
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

    # Redirected (not rebound): torch's `_api` and `_dispatch` bound the name at their import.
    redirect(dtensor_redistribute.redistribute_local_tensor, wrap)


def _patch_distribute(hooks: Hooks) -> None:
    """`distribute_tensor`."""

    def wrap(original: Callable[..., DTensor]) -> Callable[..., DTensor]:
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

    redirect(dtensor_api.distribute_tensor, wrap)


def _patch_from_local(hooks: Hooks) -> None:
    """`DTensor.from_local`: a RaggedShard needs the global shape; the piece is checked."""

    def wrap(original: Callable[..., DTensor]) -> Callable[..., DTensor]:
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

    redirect(_function_of(DTensor, "from_local"), wrap)


def _patch_sharding_propagation(hooks: Hooks) -> None:
    """The C++ dispatcher's slow path on a cache miss, and `ShardingPropagator.propagate`.

    The hooks cache their decisions (`_decisions.py`): every call that reaches Python (foreach
    ops whose C++ cache key cannot be computed; torch versions without the C++ cache) would
    otherwise run fake-tensor propagation again, ~0.1 ms per op.
    """

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
    original_propagate = ShardingPropagator.propagate

    @functools.wraps(original_propagate)
    def propagate(self: ShardingPropagator, op_info: Any) -> None:
        if op_info.schema is not None and hooks.schema_is_ragged(op_info.schema):
            op_info.output_sharding = ragged_sharding(self, op_info.schema)
            return
        original_propagate(self, op_info)

    setattr(ShardingPropagator, "propagate", propagate)  # noqa: B010


def _patch_to_local_backward(hooks: Hooks) -> None:
    """`to_local()`'s backward, which infers the global stride from placements torch knows.

    A RaggedShard gradient keeps the forward spec instead (the input's placements, contiguous).
    """
    to_torch = dtensor_api._ToTorchTensor
    original = to_torch.backward

    @functools.wraps(original)
    def to_local_backward(ctx: Any, grad_output: torch.Tensor | None) -> Any:
        spec = ctx.dtensor_spec
        if grad_output is None or not hooks.is_ragged(spec.placements):
            return original(ctx, grad_output)
        placements = ctx.grad_placements or spec.placements
        grad = DTensor.from_local(
            grad_output, spec.mesh, placements, shape=spec.shape, stride=spec.stride
        )
        return grad, None

    setattr(to_torch, "backward", staticmethod(to_local_backward))  # noqa: B010


def _patch_checkpoint(hooks: Hooks) -> None:
    """The dunders through which torch.distributed.checkpoint asks a DTensor for its chunks."""
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


def _patch_compile_cache_key(hooks: Hooks) -> None:
    """`DTensor._stable_hash_for_caching` (where torch has it): the piece joins the key.

    torch.compile's on-disk AOTAutograd cache keys a DTensor input by its spec (global shape,
    placements, mesh) and device, not by its local piece. Ranks share one cache directory by
    default and, on CPU, one device: a rank would load code compiled for another rank's
    RaggedShard piece of another shape (wrong-size asserts, crashes, or silently wrong
    results).
    """
    original = getattr(DTensor, "_stable_hash_for_caching", None)
    if original is None:
        return

    @functools.wraps(original)
    def stable_hash_for_caching(self: DTensor) -> str:
        key: str = original(self)
        if not hooks.is_ragged(self.placements):
            return key
        local = self._local_tensor
        return f"{key}/{tuple(local.shape)}/{tuple(local.stride())}"

    setattr(DTensor, "_stable_hash_for_caching", stable_hash_for_caching)  # noqa: B010


def _patch_random_fills(hooks: Hooks) -> None:
    """The dispatcher's local-results slow path, for random fills (`nn.init` after meta init).

    torch's own would offset a shared generator by a Shard's row offset, which a RaggedShard
    piece does not have.
    """
    dispatcher = dtensor_dispatch.OpDispatcher
    original = dispatcher._dispatch_get_local_results_slow_path

    @functools.wraps(original)
    def local_results(self: Any, op_call: Any, args: Any, op_info: Any, *rest: Any) -> object:
        first = args[0] if args else None
        if isinstance(first, DTensor) and hooks.is_ragged(first._spec.placements):
            filled = hooks.random_fill(op_call, first, args[1:], dict(op_info.local_kwargs))
            if filled is not None:
                return filled
        return original(self, op_call, args, op_info, *rest)

    setattr(dispatcher, "_dispatch_get_local_results_slow_path", local_results)  # noqa: B010


def _patch_full_state_dict_load(hooks: Hooks) -> None:
    """`_state_dict_utils._distribute_tensors`, which cuts full tensors by shape and offset.

    What `set_model_state_dict` with `full_state_dict` and `broadcast_from_rank0` load through;
    a RaggedShard piece has no such offset: those entries are cut by the hooks, the rest by
    torch.
    """

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
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

    redirect(state_dict_utils._distribute_tensors, wrap)


def _patch_foreach_handlers(hooks: Hooks) -> None:
    """`OpDispatcher._custom_op_handlers`: a handler per elementwise foreach op.

    An optimizer step's ops, unless torch has a handler for one; every other call of the op
    goes back to the dispatcher with the handler lifted for it (`dispatch_without_handler`).
    """
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers

    def run_foreach(op: Any, args: OpArgs, kwargs: OpKwargs) -> object:
        # `dispatch_without_handler` is looked up at each call (a test counts the calls).
        return hooks.run_foreach(op, args, kwargs, dispatch_without_handler)

    for op in hooks.foreach_ops():
        handlers.setdefault(op, run_foreach)


def _patch_pickling(hooks: Hooks) -> None:
    """`DTensor.__reduce_ex__` / `__deepcopy__` for pieces of a larger storage (`_pickle.py`)."""
    patch_pickling()


_PATCHES: tuple[Callable[[Hooks], None], ...] = (
    _patch_redistribute,
    _patch_distribute,
    _patch_from_local,
    _patch_sharding_propagation,
    _patch_to_local_backward,
    _patch_checkpoint,
    _patch_compile_cache_key,
    _patch_random_fills,
    _patch_full_state_dict_load,
    _patch_foreach_handlers,
    _patch_pickling,
)
