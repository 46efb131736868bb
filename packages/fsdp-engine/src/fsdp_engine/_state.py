"""FSDPState: what one `fully_shard` call adds to its module(s), and the hooks that drive it.

The schedule, per iteration (FSDP2's, on DBuffers):
- pre-forward: the first module to run forward becomes the root (setters never choose it)
  and initializes the shared `Context` (its subtree's states in order); every state gathers
  its group (waiting for a prefetch if one was issued), issues the gather of the group that
  came next in the previous forward, casts the inputs (mixed precision) and, when autograd
  records, routes the inputs' gradients through `_PostBackward` so it learns when its
  module's backward is done;
- post-forward: reshards unless it is the root (or told otherwise), records its place in the
  post-forward order (when a backward will follow) and hooks the outputs so that the first
  gradient reaching them gathers the group again for backward (and prefetches the group that
  finished forward just before it);
- post-backward: gradients go into the DBuffers, the group reshards, and its reduce-scatter
  starts asynchronously (at most the group's `max_reduces_in_flight` in flight);
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

from fsdp_engine._compat import (
    in_backward,
    map_tensors,
    profiler_range,
    queue_backward_callback,
)
from fsdp_engine._group import ParamGroup, used_anywhere


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class Context:
    """State shared by every FSDP state under one root."""

    states: list[FSDPState]
    # Groups by pre-forward, in this root forward and in the one before: the k-th group of a
    # forward prefetches the (k+1)-th of the previous forward, if the k-th is the same group
    # (positions, not identities: a module may run twice; control flow may change).
    forward_order: list[FSDPState] = field(default_factory=list)
    last_forward_order: list[FSDPState] = field(default_factory=list)
    # By post-forward, with autograd recording, since the last backward: backward runs the
    # groups in its reverse. Each state keeps its positions in it (one per forward run), so a
    # group prefetches the one that finished forward just before it did. The root finishes
    # forward last, so at the start of backward it prefetches the last block.
    post_forward_order: list[FSDPState] = field(default_factory=list)
    callback_queued: bool = False
    is_last_backward: bool = True
    reducing: list[FSDPState] = field(default_factory=list)
    post_optim_event: Any = None

    def reset(self) -> None:
        self.callback_queued = False
        self.reducing = []
        self.post_forward_order = []
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
    max_reduces_in_flight: int = 1  # reduces in flight when this group's backward ends
    context: Context | None = None
    # Context settings made before there is a context (setters never choose the root): the
    # context of the tree this state ends up in takes them at lazy init.
    pending_context_settings: dict[str, Any] = field(default_factory=dict)
    is_root: bool = False
    phase: Phase = Phase.IDLE
    # Per iteration, counted per forward run (a module may run more than once): runs with
    # autograd recording, post-backwards done, and runs whose backward started but whose
    # post-backward has not run (the group must stay gathered while one is open).
    _num_forward_runs: int = 0
    _num_post_backwards: int = 0
    _num_backward_runs_open: int = 0
    _modules_done: set[int] = field(default_factory=set)
    _post_forward_positions: list[int] = field(default_factory=list)  # in post_forward_order

    def reset(self) -> None:
        self.phase = Phase.IDLE
        self._num_forward_runs = 0
        self._num_post_backwards = 0
        self._num_backward_runs_open = 0
        self._modules_done = set()
        self._post_forward_positions = []

    def set_context_setting(self, name: str, value: object) -> None:
        """Sets a Context field now, or at lazy init if there is no context yet."""
        if self.context is not None:
            setattr(self.context, name, value)
        else:
            self.pending_context_settings[name] = value

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
        for state in [*states, self]:  # the root's own settings last: they win
            for name, value in state.pending_context_settings.items():
                setattr(context, name, value)
            state.pending_context_settings.clear()
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
        # Activation checkpointing recomputes forward inside backward: that is not a run of
        # its own (no order recorded, no prefetch, no post-backward owed for it).
        recompute = in_backward()
        if first:
            if self.is_root and not recompute:  # a new root forward: a new forward order
                context.last_forward_order = context.forward_order
                context.forward_order = []
            self.phase = Phase.FORWARD
            if torch.is_grad_enabled() and not recompute:
                self._num_forward_runs += 1
            if self.group is not None:
                position = len(context.forward_order)
                if not recompute:
                    context.forward_order.append(self)
                with profiler_range(f"FSDP::pre_forward({self.group.label})"):
                    self.group.unshard()
                    self.group.wait_for_unshard()
                    if not recompute:
                        self._prefetch(self._forward_targets(position), "forward")
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
        recompute = in_backward()  # activation checkpointing: backward reads these next
        # Only forwards that a backward will follow (not an eval loop, not a recompute).
        recorded = torch.is_grad_enabled() and not recompute
        if context is not None and self.group is not None and recorded:
            self._post_forward_positions.append(len(context.post_forward_order))
            context.post_forward_order.append(self)
        if self.group is not None and self.reshard_after_forward and not recompute:
            with profiler_range(f"FSDP::post_forward({self.group.label})"):
                self.group.reshard()
        if torch.is_grad_enabled() and self.group is not None:
            started = [False]  # this run's backward (its outputs get several gradients)
            output = _hook_outputs(output, lambda grad: self._pre_backward(grad, started))
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _forward_targets(self, position: int) -> list[FSDPState]:
        """The groups to gather next in forward.

        Set explicitly, or the one after this group's position in the previous forward, if
        this group held the same position there.
        """
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        last = self.context.last_forward_order if self.context else []
        if position + 1 < len(last) and last[position] is self:
            return [last[position + 1]]
        return []

    def _backward_targets(self) -> list[FSDPState]:
        """The groups to gather next in backward.

        Set explicitly, or the one that finished forward just before this group's latest
        forward run not yet backpropagated.
        """
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        if not self._post_forward_positions or self.context is None:
            return []
        position = self._post_forward_positions.pop()
        order = self.context.post_forward_order
        return [order[position - 1]] if 0 < position <= len(order) else []

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

    def _pre_backward(self, grad: torch.Tensor, started: list[bool]) -> torch.Tensor:
        context = self.context
        assert context is not None and self.group is not None
        if not context.callback_queued:
            context.callback_queued = True
            queue_backward_callback(self._end_of_backward)
        if started[0]:
            return grad
        started[0] = True
        self._num_backward_runs_open += 1
        self.phase = Phase.BACKWARD
        with profiler_range(f"FSDP::pre_backward({self.group.label})"):
            if self.unshard_in_backward:
                self.group.unshard()
                self.group.wait_for_unshard()
            self._prefetch(self._backward_targets(), "backward")
        return grad

    def post_backward(self) -> None:
        """Reshards the group, collects its gradients and starts its reduce-scatter."""
        if self.group is None:
            return
        self._num_post_backwards += 1
        self._num_backward_runs_open = max(0, self._num_backward_runs_open - 1)
        group, context = self.group, self.context
        assert context is not None
        with profiler_range(f"FSDP::post_backward({group.label})"):
            # The gathered parameters go first: the gradient buffer filled next is as large,
            # and both at once (with the gradients and the next group's prefetch) would be
            # the step's peak. The gradients stay reachable through the unsharded objects.
            if self.reshard_after_backward and not self._num_backward_runs_open:
                group.reshard()
            if group.settings.requires_gradient_sync:
                # Finish the reduces in flight before this group's gradient buffer is filled,
                # so that their buffers are freed first: one group's gradients at a time.
                while len(context.reducing) >= self.max_reduces_in_flight:
                    context.reducing.pop(0).group.wait_for_reduce()  # type: ignore[union-attr]
            group.collect_gradients()
            if not group.settings.requires_gradient_sync:
                return
            if group.has_reduce:
                # A reduce from a backward that was not the last (set_is_last_backward):
                # finish it first, so that this one adds to its gradients.
                finish_reduces([group])
            while len(context.reducing) >= self.max_reduces_in_flight:
                context.reducing.pop(0).group.wait_for_reduce()  # type: ignore[union-attr]
            group.reduce(async_op=True)
            context.reducing.append(self)

    def _end_of_backward(self) -> None:
        context = self.context
        assert context is not None
        with profiler_range("FSDP::end_of_backward"):
            for state in context.states:
                if state._num_post_backwards < state._num_forward_runs:
                    state._num_backward_runs_open = 0  # backward is over: none is still open
                    state.post_backward()
                elif state.group is not None and state.reshard_after_backward:
                    state.group.reshard()  # e.g. prefetched but never run
            if context.is_last_backward:
                finish_reduces([s.group for s in context.states if s.group is not None])
                context.reducing = []
            context.post_forward_order = []
            for state in context.states:
                state.reset()
            context.callback_queued = False


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
