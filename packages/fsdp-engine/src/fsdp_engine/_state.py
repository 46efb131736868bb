"""FSDPState: what one `fully_shard` call adds to its module(s), and the hooks that drive it.

The schedule, per iteration (FSDP2's, on DBuffers):
- pre-forward: the first module to run forward becomes the root and initializes the shared
  `Context` (its subtree's states in order); every state gathers its group (waiting for a
  prefetch if one was issued), issues the next group's gather asynchronously, casts the inputs
  (mixed precision) and, when autograd records, routes the inputs' gradients through
  `_PostBackward` so it learns when its module's backward is done;
- post-forward: reshards unless it is the root (or told otherwise) and hooks the outputs so
  that the first gradient reaching them gathers the group again for backward (and prefetches
  the group that runs backward next);
- post-backward: gradients go into the DBuffers, the group reshards, and its reduce-scatter
  starts asynchronously (at most `max_reduces_in_flight` at once);
- end of backward (a callback queued on the autograd engine): groups no hook reached are
  reduced too, every reduce is waited for, and the sharded `.grad`s are handed out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_engine._compat import map_tensors, profiler_range, queue_backward_callback
from fsdp_engine._group import ParamGroup, used_anywhere


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class Context:
    """State shared by every FSDP state under one root."""

    states: list[FSDPState]
    forward_order: list[FSDPState] = field(default_factory=list)  # by pre-forward
    # By post-forward: backward runs the groups in its reverse. The root finishes forward
    # last, so at the start of backward it prefetches the last block (pre-forward order
    # would put it first, with nothing before it to prefetch).
    post_forward_order: list[FSDPState] = field(default_factory=list)
    order_frozen: bool = False
    callback_queued: bool = False
    is_last_backward: bool = True
    max_reduces_in_flight: int = 1
    reducing: list[FSDPState] = field(default_factory=list)
    post_optim_event: Any = None

    def reset(self) -> None:
        self.callback_queued = False
        self.reducing = []
        for state in self.states:
            state.reset()


@dataclass(eq=False)
class FSDPState:
    """The per-call state: its modules, its group and its schedule settings."""

    modules: tuple[nn.Module, ...]
    group: ParamGroup | None  # None when every parameter was taken by nested calls
    reshard_after_forward: bool | None
    mp_policy: MixedPrecisionPolicy
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    forward_prefetch: list[FSDPState] | None = None
    backward_prefetch: list[FSDPState] | None = None
    context: Context | None = None
    is_root: bool = False
    phase: Phase = Phase.IDLE
    _forward_ran: bool = False  # with autograd recording, in this iteration
    _modules_done: set[int] = field(default_factory=set)
    _pre_backward_done: bool = False
    _post_backward_done: bool = False

    def reset(self) -> None:
        self.phase = Phase.IDLE
        self._forward_ran = False
        self._modules_done = set()
        self._pre_backward_done = False
        self._post_backward_done = False

    # -- lazy initialization ------------------------------------------------------------------

    def lazy_init(self) -> None:
        """Makes this state the root of every FSDP state in its modules' subtrees."""
        if self.context is not None:
            return
        states: list[FSDPState] = []
        for module in self.modules:
            for sub in module.modules():
                state = getattr(sub, "_fsdp_engine_state", None)
                if isinstance(state, FSDPState) and state not in states:
                    states.append(state)
        for state in states:
            if state.context is not None:
                raise RuntimeError(
                    "fully_shard: this module's subtree holds an FSDP module that already ran "
                    "under another root; run forward on one root module"
                )
        context = Context(states)
        for state in states:
            state.context = context
            state.is_root = state is self
            if state.reshard_after_forward is None:
                state.reshard_after_forward = not state.is_root

    # -- forward ------------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        context = self.context
        assert context is not None
        if self.is_root and context.post_optim_event is not None:
            # The optimizer step recorded this event: the gathers below must see its writes.
            context.post_optim_event.wait()
            context.post_optim_event = None
        if self.is_root and self.phase is not Phase.FORWARD:
            # Gradient shards nobody holds any more (zero_grad set them to None) go back now,
            # not after this forward and backward (FSDP2 holds none across steps either).
            for state in context.states:
                if state.group is not None:
                    state.group.release_unused_gradients()
        first = self.phase is not Phase.FORWARD  # the first module of this group to run
        if first:
            self.phase = Phase.FORWARD
            if torch.is_grad_enabled():
                self._forward_ran = True
            if not context.order_frozen and self.group is not None:
                context.forward_order.append(self)
            if self.group is not None:
                with profiler_range(f"FSDP::pre_forward({self.group.label})"):
                    self.group.unshard()
                    self.group.wait_for_unshard()
                    self._prefetch(self._forward_targets(), "forward")
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            dtype = self.mp_policy.param_dtype
            args, kwargs = _cast_floats((args, kwargs), dtype)
        if first and torch.is_grad_enabled() and self.group is not None:
            # Only the first module's inputs: their gradients come after the backward of
            # every module of the group (a list group runs its modules in sequence).
            args, kwargs = _PostBackward.route(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self._modules_done.add(id(module))
        if len(self._modules_done) < len(self.modules):
            return output  # a list group reshards after its last module
        self._modules_done = set()
        self.phase = Phase.IDLE
        context = self.context
        if context is not None and not context.order_frozen and self.group is not None:
            context.post_forward_order.append(self)
        if self.group is not None and self.reshard_after_forward:
            with profiler_range(f"FSDP::post_forward({self.group.label})"):
                self.group.reshard()
        if torch.is_grad_enabled() and self.group is not None:
            output = _hook_outputs(output, self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        context = self.context
        return _next_in(context.forward_order if context else [], self, +1, context)

    def _backward_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        context = self.context
        return _next_in(context.post_forward_order if context else [], self, -1, context)

    @staticmethod
    def _prefetch(targets: Sequence[FSDPState], when: str) -> None:
        for target in targets:
            group = target.group
            if group is None or group.is_unsharded:
                continue
            if when == "backward" and not target.unshard_in_backward:
                continue
            with profiler_range(f"FSDP::{when}_prefetch({group.label})"):
                group.unshard(async_op=True)

    # -- backward -----------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        context = self.context
        assert context is not None and self.group is not None
        if not context.callback_queued:
            context.callback_queued = True
            queue_backward_callback(self._end_of_backward)
        if self._pre_backward_done:
            return grad
        self._pre_backward_done = True
        self.phase = Phase.BACKWARD
        with profiler_range(f"FSDP::pre_backward({self.group.label})"):
            if self.unshard_in_backward:
                self.group.unshard()
                self.group.wait_for_unshard()
            self._prefetch(self._backward_targets(), "backward")
        return grad

    def post_backward(self) -> None:
        """Reshards the group, collects its gradients and starts its reduce-scatter."""
        if self._post_backward_done or self.group is None:
            return
        self._post_backward_done = True
        group, context = self.group, self.context
        assert context is not None
        with profiler_range(f"FSDP::post_backward({group.label})"):
            # The gathered parameters go first: the gradient buffer filled next is as large,
            # and both at once (with the gradients and the next group's prefetch) would be
            # the step's peak. The gradients stay reachable through the unsharded objects.
            if self.reshard_after_backward:
                group.reshard()
            if group.settings.requires_gradient_sync:
                # Finish the reduces in flight before this group's gradient buffer is filled,
                # so that their buffers are freed first: one group's gradients at a time.
                while len(context.reducing) >= context.max_reduces_in_flight:
                    context.reducing.pop(0).group.wait_for_reduce()  # type: ignore[union-attr]
            group.collect_gradients()
            if not group.settings.requires_gradient_sync:
                return
            if group.has_reduce:
                # A reduce from a backward that was not the last (set_is_last_backward):
                # finish it first, so that this one adds to its gradients.
                finish_reduces([group])
            while len(context.reducing) >= context.max_reduces_in_flight:
                context.reducing.pop(0).group.wait_for_reduce()  # type: ignore[union-attr]
            group.reduce(async_op=True)
            context.reducing.append(self)

    def _end_of_backward(self) -> None:
        context = self.context
        assert context is not None
        with profiler_range("FSDP::end_of_backward"):
            for state in context.states:
                if state._forward_ran and not state._post_backward_done:
                    state.post_backward()
                elif state.group is not None and state.reshard_after_backward:
                    state.group.reshard()  # e.g. prefetched but never run
            context.order_frozen = True
            if context.is_last_backward:
                finish_reduces([s.group for s in context.states if s.group is not None])
                context.reducing = []
            for state in context.states:
                state.reset()
            context.callback_queued = False


def _next_in(
    order: list[FSDPState], state: FSDPState, offset: int, context: Context | None
) -> list[FSDPState]:
    """The state `offset` places from `state` in a recorded order (none before it is)."""
    if context is None or not context.order_frozen or state not in order:
        return []
    index = order.index(state) + offset
    return order[index : index + 1] if index >= 0 else []


def finish_reduces(candidates: list[ParamGroup]) -> None:
    """Waits for the groups' pending reduces and hands out their sharded gradients.

    Every rank calls it for the same groups in the same order (it runs a small collective).
    """
    groups = [group for group in candidates if group.has_reduce]
    for group in groups:
        group.wait_for_reduce()
    by_mesh: dict[int, list[ParamGroup]] = {}
    for group in groups:
        by_mesh.setdefault(id(group.mesh), []).append(group)
    for same_mesh in by_mesh.values():
        for group, used in zip(same_mesh, used_anywhere(same_mesh), strict=True):
            group.assign_gradients(used)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs after the module's backward."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)

    @classmethod
    def route(
        cls, state: FSDPState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves: list[torch.Tensor] = []
        _visit((args, kwargs), lambda t: leaves.append(t) if t.requires_grad else None)
        if not leaves:
            return args, kwargs
        routed = iter(cls.apply(state, *leaves))  # type: ignore[no-untyped-call]
        new_args, new_kwargs = map_tensors(
            (args, kwargs), lambda t: next(routed) if t.requires_grad else t
        )
        return new_args, new_kwargs


def _hook_outputs(output: Any, hook: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    def register(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(hook)  # type: ignore[no-untyped-call]
        return t

    return map_tensors(output, register)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(tree, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _visit(tree: Any, fn: Callable[[torch.Tensor], object]) -> None:
    map_tensors(tree, lambda t: (fn(t), t)[1])
