"""FSDPModule: the mixin `fully_shard` swaps into a module's class, with FSDP2's methods.

It subclasses torch's `FSDPModule`, so `isinstance(m, torch.distributed.fsdp.FSDPModule)`
holds for every module ours shards: torch's pipeline schedules, torchtitan, torchft and
accelerate find our modules the way they find FSDP2's and call these methods. Every method of
torch's class is overridden here with the same name, arguments and recurse semantics (checked
when this module is imported: none may fall through to torch's code, which would read an FSDP2
state ours does not have); each one works or raises NotImplementedError naming the reason (the
README's parity table lists them). The state lives in `module._fsdp_engine_state`
(`_state.py`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from fsdp_engine._compat import (
    ApplyOverride,
    TorchFSDPModule,
    TorchGradientReductionHandle,
    TorchUnshardHandle,
    in_backward,
    parameter_slots,
    torch_fsdp_methods,
)
from fsdp_engine._group import move_storage
from fsdp_engine._param import ManagedParam
from fsdp_engine._state import STATE_ATTR, FSDPState, states_under
from fsdp_engine._subclass import SubclassParam


class UnshardHandle(TorchUnshardHandle):
    """A pending `unshard(async_op=True)`; `wait()` makes the gathered parameters usable.

    Example:
        >>> layer = fully_shard(model.layers[0])
        >>> handle = layer.unshard(async_op=True)
        >>> handle.wait()
    """

    def __init__(self, state: FSDPState) -> None:
        self._state: FSDPState | None = state

    def wait(self) -> None:
        """Waits for the all-gather and registers the unsharded parameters (idempotent)."""
        state, self._state = self._state, None
        if state is not None and state.group is not None and state.group.is_unsharded:
            state.group.wait_for_unshard()


class GradientReductionHandle(TorchGradientReductionHandle):
    """A pending `finalize_backward(async_op=True)`; `wait()` hands out the gradients.

    Example:
        >>> model = fully_shard(model)
        >>> model.set_manual_backward_finalization(True)
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> handle = model.finalize_backward(async_op=True)  # the reduces are in flight
        >>> handle.wait()
        >>> model.layers[0].weight.grad is not None
        True
    """

    def __init__(self, wait: Callable[[], None] | None) -> None:
        self._wait = wait

    def wait(self) -> None:
        """Waits for the reduces and hands out the sharded gradients (idempotent)."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()


def state_of(module: object) -> FSDPState:
    """The engine's state of an FSDPModule (the mixin's `self` too), or a ValueError."""
    state = getattr(module, STATE_ATTR, None)
    if not isinstance(state, FSDPState):
        raise ValueError(
            f"{type(module).__name__} is not an fsdp_engine FSDPModule: call "
            f"fsdp_engine.fully_shard on it first"
        )
    return state


def _configure(module: object, recurse: bool, **changes: Any) -> None:
    """The one way a setter changes settings: a new frozen config for each state it reaches.

    `recurse`: every FSDP state in the module's subtree, else the module's own.
    """
    states = states_under([cast(nn.Module, module)]) if recurse else [state_of(module)]
    for state in states:
        state.config = dataclasses.replace(state.config, **changes)


def _check_bool(what: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return value


def _not_supported(method: str, reason: str) -> NotImplementedError:
    return NotImplementedError(f"fsdp_engine does not support {method}: {reason}")


class FSDPModule(ApplyOverride, TorchFSDPModule):
    """Mixin of every module `fully_shard` was applied to (its class becomes FSDP<Name>).

    A subclass of torch's `FSDPModule`: code that looks for FSDP2 modules finds these.

    Example:
        >>> import torch.distributed.fsdp
        >>> model = fully_shard(model)
        >>> isinstance(model, torch.distributed.fsdp.FSDPModule), type(model).__name__
        (True, 'FSDPNet')
        >>> model.set_requires_gradient_sync(False)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers that build a new instance of their own class (a slice of a sharded
        # ModuleList or Sequential) get the original class, not an FSDP module without state.
        orig: Any = cls.__bases__[-1] if cls.__bases__[0] is FSDPModule else nn.Module
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported: its "
            f"parameters are views of the group's buffers; deepcopy the model before "
            f"fully_shard, or build a new one and load its state dict"
        )

    # -- unshard / reshard --------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gathers this module's group (not recursive); follows `param_dtype`.

        Args:
            async_op: Return a handle at once; `wait()` it before using the parameters.

        Returns:
            An UnshardHandle if `async_op`, else None (the parameters are unsharded).

        Example:
            >>> model = fully_shard(model)
            >>> model.unshard()
            >>> weight = model.layers[0].weight  # the gathered parameter, not a DTensor
            >>> isinstance(weight, torch.nn.Parameter), hasattr(weight, "placements")
            (True, False)
        """
        state = state_of(self)
        _check_bool("async_op", async_op)
        handle = UnshardHandle(state)
        if state.group is not None:
            state.group.unshard(async_op=async_op)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Frees this module's gathered parameters (not recursive)."""
        state = state_of(self)
        if state.group is not None:
            state.group.reshard()

    def reset_iter_state(self) -> None:
        """Forgets the iteration in progress (after an exception mid-iteration); root only."""
        state = state_of(self)
        if state.context is not None:
            state.context.reset()

    # -- gradient synchronization -------------------------------------------------------------

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward waits for its reduce-scatters and sets the `.grad`s.

        Manual finalization (`set_manual_backward_finalization`) supersedes it.
        """
        state = state_of(self)
        value = _check_bool("is_last_backward", is_last_backward)
        state.change_settings(lambda s: dataclasses.replace(s, is_last_backward=value))

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: keep accumulating unsharded gradients, reduce at the next synced backward.

        Example:
            >>> model = fully_shard(model)
            >>> model.set_requires_gradient_sync(False)  # e.g. all micro-batches but the last
        """
        value = _check_bool("requires_gradient_sync", requires_gradient_sync)
        _configure(self, recurse, requires_gradient_sync=value)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but skips the all-reduce over the replicate axis."""
        value = _check_bool("requires_all_reduce", requires_all_reduce)
        _configure(self, recurse, requires_all_reduce=value)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients are summed over ranks and divided by `factor` (not recursive)."""
        value: object = factor
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"gradient divide factor must be a number > 0, got {factor!r}")
        _configure(self, False, divide_factor=float(value))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of `set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM and one division by the data-parallel size (not recursive)."""
        value = _check_bool("enable", enable)
        _configure(self, False, force_sum_reduction=value)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: parameters no rank used get a zero sharded gradient instead of None."""
        value = _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        _configure(self, recurse, reduce_scatter_unused_params=value)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Runs `hook(local_grad)` on each reduced flat gradient shard of this module's group.

        Not recursive (as FSDP2): other groups keep their own hook. It runs after the
        reduce-scatter, or after the all-reduce over the replicate axis with HSDP, and before
        the sharded `.grad`s are handed out, on the current stream; `stream` is accepted for
        FSDP2 compatibility. torchft installs its cross-replica all-reduce this way.

        Example:
            >>> model = fully_shard(model)
            >>> model.set_all_reduce_hook(lambda shard: shard.mul_(0.5))
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        _configure(self, False, all_reduce_hook=hook)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Sets how many reduce-scatters may be in flight when this group's backward ends.

        Each holds its group's full gradient buffer until it is done (default 1).

        Example:
            >>> model = fully_shard(model)
            >>> model.set_reduce_scatter_max_input_buffers(2)  # every group (recurse=True)
        """
        value: object = max_input_buffers
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}")
        _configure(self, recurse, max_reduces_in_flight=value)

    # -- schedule -----------------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the gathered parameters after forward (bool only)."""
        value = _check_bool("reshard_after_forward", reshard_after_forward)
        _configure(self, recurse, reshard_after_forward=value)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free the gathered parameters after backward."""
        value = _check_bool("reshard_after_backward", reshard_after_backward)
        _configure(self, recurse, reshard_after_backward=value)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False skips the all-gather in backward.

        For modules whose backward does not read their parameters, e.g. an embedding.
        """
        value = _check_bool("unshard_in_backward", unshard_in_backward)
        _configure(self, False, unshard_in_backward=value)

    def set_modules_to_forward_prefetch(self, modules: Sequence[TorchFSDPModule]) -> None:
        """Gather these modules' groups asynchronously when this module's forward starts.

        Modules of this engine only (an FSDP2 module raises).
        """
        targets = _prefetch_states(modules)
        _configure(self, False, forward_prefetch=targets)

    def set_modules_to_backward_prefetch(self, modules: Sequence[TorchFSDPModule]) -> None:
        """Gather these modules' groups asynchronously when this module's backward starts."""
        targets = _prefetch_states(modules)
        _configure(self, False, backward_prefetch=targets)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next forward waits for `event` (CUDA) instead of the current stream."""
        state = state_of(self)
        if not hasattr(event, "wait") and not hasattr(event, "query"):
            raise TypeError(f"event must be a torch.Event or torch.cuda.Event, got {event!r}")
        state.change_settings(lambda s: dataclasses.replace(s, post_optim_event=event))

    # -- not supported ------------------------------------------------------------------------

    def set_custom_all_gather(self, comm: Any) -> None:
        """Not supported: DBuffer all-gathers straight into its own persistent buffer."""
        raise _not_supported(
            "set_custom_all_gather",
            "the all-gather writes in place into the group's DBuffer, whose parameters are "
            "views of it; a custom comm that allocates its own output cannot be zero-copy",
        )

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Not supported: DBuffer reduce-scatters its own gradient buffer."""
        raise _not_supported(
            "set_custom_reduce_scatter",
            "the reduce-scatter reads the group's DBuffer gradient buffer in place",
        )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Not supported: DBuffer allocates its buffers with the tensor allocator."""
        raise _not_supported(
            "set_allocate_memory_from_process_group_for_comm",
            "DBuffer allocates its communication buffers itself (one per group and dtype)",
        )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: needs symmetric-memory staging buffers, which DBuffer does not use."""
        raise _not_supported(
            "set_symm_mem_for_comm",
            "symmetric memory needs staging buffers from a symmetric allocator; DBuffer "
            "gathers in place into ordinary device memory (and CPU has no symmetric memory)",
        )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Not supported: DBuffer reduce-scatters on the mesh's own process group."""
        raise _not_supported(
            "set_separate_reduce_scatter_group",
            "DBuffer runs its collectives on the mesh's process groups",
        )

    # torch 2.15's additions; the engine has neither mode yet.
    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Not supported: a reshard frees the group's unsharded DBuffer storage."""
        raise _not_supported(
            "set_keep_unsharded_storage",
            "a reshard frees the group's unsharded DBuffer; a mode that keeps it (for CUDA "
            "graph capture) is not implemented",
        )

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether backward passes leave the iteration open until `finalize_backward()`.

        Call it on the root before backward (torch's pipeline stages do, per micro-batch).
        Each backward pass then runs the post-backward of the groups it reached (reducing or
        accumulating per `set_requires_gradient_sync`) and keeps the iteration open;
        `finalize_backward()` reduces what is left and hands out the sharded gradients.
        Supersedes `set_is_last_backward`. The mode cannot change while an iteration is open.

        Example:
            >>> model = fully_shard(model)
            >>> model.set_manual_backward_finalization(True)
            >>> model.set_requires_gradient_sync(False)
            >>> for micro_batch in torch.randn(2, 2, 8):
            ...     model(micro_batch).sum().backward()
            >>> model.set_requires_gradient_sync(True)
            >>> model.finalize_backward()  # one reduce of both micro-batches' gradients
        """
        state = state_of(self)
        value = _check_bool("enabled", enabled)
        context = state.context
        if context is None:
            state.change_settings(lambda s: dataclasses.replace(s, manual_finalization=value))
            return
        if not state.is_root:
            raise RuntimeError(
                f"set_manual_backward_finalization must be called on the root FSDP module, "
                f"not on {type(self).__name__}"
            )
        current = context.settings.manual_finalization
        if value != current and (context.manual_active or in_backward()):
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode while a backward "
                "iteration is open: call finalize_backward() (or reset_iter_state()) first"
            )
        context.settings = dataclasses.replace(context.settings, manual_finalization=value)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Ends the backward iteration: reduces what is left and hands out the gradients.

        For manual finalization (above); after an ordinary backward it only waits for
        reduces still in flight. A no-op before the root's first forward.

        Args:
            async_op: Return a GradientReductionHandle at once, the reduces in flight; call
                its `wait()` before reading the gradients (the next forward waits for it).

        Returns:
            The handle if `async_op`, else None (the gradients are handed out).
        """
        state = state_of(self)
        _check_bool("async_op", async_op)
        context = state.context
        wait = context.finalize() if context is not None else None
        handle = GradientReductionHandle(wait)
        if async_op:
            return handle
        handle.wait()
        return None

    # FSDP2 internals that callers reach: none has a counterpart in ours.
    def _get_fsdp_state(self) -> Any:
        raise _not_supported(
            "FSDPModule._get_fsdp_state",
            "an fsdp_engine module has no torch FSDPState (its state is an fsdp_engine "
            "FSDPState on the module); use the FSDPModule methods",
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise _not_supported(
            "FSDPModule._set_unshard_async_op",
            "the engine gathers on the current stream; there is no separate all-gather "
            "stream whose waits could be skipped",
        )

    # -- nn.Module integration ----------------------------------------------------------------

    def _fsdp_convert(self, fn: Callable[[torch.Tensor], torch.Tensor], apply: Any) -> Any:
        # `.to()`, `.cuda()`, `to_empty()`, `.double()`: the group's parameters are views of
        # its DBuffers, so convert the DBuffers (one tensor each) and rebind the parameters;
        # `apply()` (nn.Module's own conversion) sees everything else.
        state = getattr(self, STATE_ATTR, None)
        group = state.group if isinstance(state, FSDPState) else None
        if group is None:
            return apply()
        group.reshard()
        for subclass_param in group.subclass_params:  # first: it may refuse the conversion
            subclass_param.convert(fn)
        held: list[ManagedParam | SubclassParam] = [*group.params, *group.subclass_params]
        saved = [(p, module, attr) for p in held for module, attr in p.locations]
        for _, module, attr in saved:
            del parameter_slots(module)[attr]
        try:
            result = apply()
        finally:
            for param, module, attr in saved:
                parameter_slots(module)[attr] = param.sharded
        move_storage(group, fn)
        return result


def _prefetch_states(modules: object) -> tuple[FSDPState, ...]:
    if not isinstance(modules, Iterable) or isinstance(modules, nn.Module):
        raise TypeError(f"modules must be a list of FSDPModules, got {type(modules).__name__}")
    states = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"prefetch targets must be FSDPModules (fully_shard them first); got "
                f"{type(module).__name__}"
            )
        states.append(state_of(module))
    return tuple(states)


def _refuse_unknown_methods() -> None:
    """Every method of torch's FSDPModule that ours does not define raises, naming itself.

    On the supported torch versions ours defines all of them (a test checks it); this keeps a
    method a later torch adds from running torch's FSDP2 code on a module without its state.
    """
    for name in torch_fsdp_methods():
        if any(name in vars(cls) for cls in (FSDPModule, ApplyOverride)):
            continue

        def refuse(self: object, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise _not_supported(
                f"FSDPModule.{_name}",
                f"this torch ({torch.__version__}) added it after fsdp_engine was written",
            )

        setattr(FSDPModule, name, refuse)


_refuse_unknown_methods()
