"""FSDPState: what one `fully_shard` call adds to its module(s), and the hooks that drive it.

The schedule, per iteration (FSDP2's, on DBuffers):
- pre-forward: the first module to run forward becomes the root (setters never choose it)
  and initializes the shared `Context` (its subtree's states in order); every state gathers
  its group (waiting for a prefetch if one was issued), issues the gather of the group that
  came next in the previous forward, casts the inputs (mixed precision) and, when autograd
  records, routes the inputs' gradients through `PostBackward` so it learns when its
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

import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_engine._autograd import PostBackward, cast_floats, hook_outputs
from fsdp_engine._compat import (
    in_backward,
    profiler_range,
    queue_backward_callback,
)
from fsdp_engine._config import GroupConfig, RootSettings, SettingsChange
from fsdp_engine._group import ParamGroup, adopt_assigned, used_anywhere
from fsdp_engine._same_model import check_groups_agree
from fsdp_engine._spmd import refuse_spmd_type_checking

STATE_ATTR = "_fsdp_engine_state"  # where fully_shard keeps a module's FSDPState


class TrainingState(enum.Enum):
    """Where a group is in the iteration (one per `fully_shard` call)."""

    IDLE = "idle"  # between iterations, or between a run's forward and its backward
    FORWARD = "forward"  # a run's forward is under way
    PRE_BACKWARD = "pre_backward"  # a run's backward started: gathered for it
    POST_BACKWARD = "post_backward"  # a run's backward ended: gradients collected, reducing


_I, _F, _PRE, _POST = (
    TrainingState.IDLE,
    TrainingState.FORWARD,
    TrainingState.PRE_BACKWARD,
    TrainingState.POST_BACKWARD,
)
# The transitions the schedule makes (docs/architecture.md: the table with their events).
# Refused: backward reaching a group whose forward has not finished, and a forward (other
# than a checkpointed recompute, which changes no training state) into a group whose
# backward never ended; both mean an earlier exception left the iteration half done. The end
# of backward and `reset_iter_state` put every group back to IDLE.
_ALLOWED: dict[TrainingState, frozenset[TrainingState]] = {
    # IDLE -> IDLE: the outer end of a nested run (a registered method calling forward);
    # IDLE -> POST_BACKWARD: the end of backward closes a run whose hooks got no gradient.
    _I: frozenset({_I, _F, _PRE, _POST}),
    _F: frozenset({_F, _I}),  # FORWARD -> FORWARD: a list group's next module, a nested run
    _PRE: frozenset({_PRE, _POST}),  # PRE -> PRE: another run of the module (it ran twice)
    _POST: frozenset({_PRE, _POST}),
}


def states_under(modules: Iterable[nn.Module]) -> list[FSDPState]:
    """The FSDP states in the modules' subtrees, each once, in module order."""
    found: dict[int, FSDPState] = {}
    for module in modules:
        for sub in module.modules():
            state = getattr(sub, STATE_ATTR, None)
            if isinstance(state, FSDPState):
                found.setdefault(id(state), state)
    return list(found.values())


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
    settings: RootSettings = field(default_factory=RootSettings)
    reducing: list[FSDPState] = field(default_factory=list)
    # Manual finalization (torch 2.15's set_manual_backward_finalization): each backward pass
    # runs the post-backward of the groups it reached and keeps the iteration open;
    # `finalize` then reduces what is left and hands the gradients out. `manual_active`:
    # a backward ran in this mode and `finalize` has not yet closed the iteration.
    manual_active: bool = False
    finalizing: Callable[[], None] | None = None  # the pending wait of `finalize(async)`
    # The root's forward is under way; its outputs got hooks and no gradient reached them
    # yet; group runs since the root's forward made outside it (a chunked loss's head);
    # backward passes that ended while both held (the chunks' passes, which reduce only the
    # groups they reached and leave the iteration open).
    root_in_forward: bool = False
    root_output_open: bool = False
    spmd_typed: bool = False  # some state's spmd_typed
    runs_outside: int = 0
    partial_passes: int = 0

    def open_root_output(self) -> None:
        self.root_output_open = True

    def reach_root_output(self, grad: torch.Tensor) -> torch.Tensor:
        self.root_output_open = False
        return grad

    def reset(self) -> None:
        """Forgets the iteration in progress: every group back to IDLE."""
        self.callback_queued = False
        self.reducing = []
        self.post_forward_order = []
        self.manual_active = False
        self.finalizing = None
        self.root_in_forward = False
        self.root_output_open = False
        self.runs_outside = 0
        self.partial_passes = 0
        for state in self.states:
            state.reset()

    def finalize(self) -> Callable[[], None]:
        """Ends the backward iteration outside backward; returns what waits for it.

        Every group whose backward started, whose forward got no backward, or whose
        gradients were accumulated without a reduce (gradient sync off) runs its
        post-backward now, with the settings in force (the reduces start here); the returned
        function waits for them, hands out the sharded gradients and resets the iteration.
        """
        if in_backward():
            raise RuntimeError("finalize_backward() runs after backward, not inside it")
        if self.finalizing is not None:
            raise RuntimeError(
                "the previous finalize_backward(async_op=True) was not waited on: call its "
                "handle's wait() first"
            )
        for state in self.states:
            if state.needs_post_backward(manual=False) or state.needs_reduce:
                state.close_backward_runs()
                state.post_backward()
            elif state.group is not None and state.config.reshard_after_backward:
                state.group.reshard()

        def wait() -> None:
            finish_reduces(self.states)
            self.reset()

        self.finalizing = wait
        return wait


@dataclass(eq=False)
class FSDPState:
    """The per-call state: its modules, its group, its config and its training state."""

    modules: tuple[nn.Module, ...]
    group: ParamGroup | None  # None when every parameter was taken by nested calls
    config: GroupConfig
    mp_policy: MixedPrecisionPolicy
    context: Context | None = None
    # Root settings changed before there is a context (setters never choose the root): the
    # context of the tree this state ends up in applies them at lazy init, in order.
    pending_settings: list[SettingsChange] = field(default_factory=list)
    is_root: bool = False
    # Some parameter is a plain tensor with spmd_types annotations (`_spmd.py`).
    spmd_typed: bool = False
    training_state: TrainingState = TrainingState.IDLE
    # Per iteration, counted per forward run (a module may run more than once): runs with
    # autograd recording, post-backwards done, and runs whose backward started but whose
    # post-backward has not run (the group must stay gathered while one is open).
    _num_forward_runs: int = 0
    _num_post_backwards: int = 0
    _num_backward_runs_open: int = 0
    _modules_done: set[int] = field(default_factory=set)
    _modules_needed: int = 1  # modules whose forward ends this run (all, inside the root's)
    _post_forward_positions: list[int] = field(default_factory=list)  # in post_forward_order
    # Gradients went into the group's gradient buffer with gradient sync off and no reduce
    # has taken them since (a property of the buffer: it outlives the iteration).
    needs_reduce: bool = False
    # A checkpointed recompute is under way (its first module ran). Recomputes leave the
    # training state alone: a non-reentrant one stops as soon as it has what backward needs,
    # so its post-forward may never run; the group's post-backward ends it.
    _recomputing: bool = False

    def end_backward_pass(self) -> None:
        """One backward pass of a manually finalized iteration ended: back to IDLE.

        The counts of forward runs and post-backwards stay: finalize() closes the runs no
        pass reached.
        """
        self.training_state = TrainingState.IDLE
        self._num_backward_runs_open = 0
        self._recomputing = False

    def reset(self) -> None:
        self.training_state = TrainingState.IDLE
        self._num_forward_runs = 0
        self._num_post_backwards = 0
        self._num_backward_runs_open = 0
        self._modules_done = set()
        self._post_forward_positions = []
        self._recomputing = False

    def needs_post_backward(self, *, manual: bool) -> bool:
        """Whether the end of a backward pass must run this group's post-backward.

        Its backward started in this pass but its inputs needed no gradient (no hook tells it
        its backward ended); or, unless finalization is manual (later passes may still reach
        it), it ran forward and got no gradient at all. A group that ran forward for several
        micro-batches (a pipeline schedule: all forwards, then a backward per micro-batch) is
        in PRE_BACKWARD again in each later pass.
        """
        if self.training_state is TrainingState.PRE_BACKWARD:
            return True
        return not manual and self._num_post_backwards < self._num_forward_runs

    def close_backward_runs(self) -> None:
        """Backward is over: no run of this group is still open."""
        self._num_backward_runs_open = 0

    @property
    def label(self) -> str:
        return self.group.label if self.group is not None else type(self.modules[0]).__name__

    def _to(self, new: TrainingState) -> None:
        old = self.training_state
        if new not in _ALLOWED[old]:
            raise RuntimeError(
                f"fully_shard: {self.label} cannot go from {old.value} to {new.value}: "
                + _WHY_REFUSED.get((old, new), "the iteration is out of order")
                + "; after an exception mid-iteration call reset_iter_state() on the root"
            )
        self.training_state = new

    def change_settings(self, change: SettingsChange) -> None:
        """Changes the root settings now, or at lazy init if there is no context yet."""
        if self.context is not None:
            self.context.settings = change(self.context.settings)
        else:
            self.pending_settings.append(change)

    # -- lazy initialization ------------------------------------------------------------------

    def lazy_init(self) -> None:
        """Makes this state the root of every FSDP state in its modules' subtrees."""
        if self.context is not None:
            return
        states = states_under(self.modules)
        for state in states:
            if state.context is not None:
                raise RuntimeError(
                    "fully_shard: this module's subtree holds an FSDP module that already ran "
                    "under another root; run forward on one root module"
                )
        context = Context(states)
        context.spmd_typed = any(state.spmd_typed for state in states)
        for state in [*states, self]:  # the root's own settings last: they win
            for change in state.pending_settings:
                context.settings = change(context.settings)
            state.pending_settings.clear()
        check_groups_agree(
            self.modules, [(s.modules[0], s.group) for s in states if s.group is not None]
        )
        for state in states:
            if state.group is not None:  # parameters a user assigned since fully_shard
                modules = {module for p in state.group.params for module, _ in p.locations}
                adopt_assigned(state.group, modules, "a parameter assigned after fully_shard")
        for state in states:
            state.context = context
            state.is_root = state is self
            if state.config.reshard_after_forward is None:  # the one place it is resolved
                state.config = dataclasses.replace(
                    state.config, reshard_after_forward=not state.is_root
                )

    # -- forward ------------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        context = self.context
        assert context is not None
        # Activation checkpointing recomputes forward inside backward: that is not a run of
        # its own (no order recorded, no prefetch, no post-backward owed for it).
        recompute = in_backward()
        if recompute:
            first = not self._recomputing  # this group's first module (a list group)
            self._recomputing = True
        else:
            first = self.training_state is not TrainingState.FORWARD
            if first:
                if self.is_root:
                    self._start_root_forward(context)
                self._to(TrainingState.FORWARD)
                # Inside the root's forward a list group's run is all its modules; outside
                # it (a chunked loss calling the head alone) it is the module called.
                self._modules_needed = len(self.modules) if context.root_in_forward else 1
                if not context.root_in_forward and not self.is_root:
                    context.runs_outside += 1
        if first:
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
            args, kwargs = cast_floats((args, kwargs), dtype)
        if first and torch.is_grad_enabled() and self.group is not None:
            # Only the first module's inputs: their gradients come after the backward of
            # every module of the group (a list group runs its modules in sequence).
            args, kwargs = PostBackward.route(self, args, kwargs)
        return args, kwargs

    def _start_root_forward(self, context: Context) -> None:
        if context.root_output_open and context.partial_passes:
            context.reset()
            raise RuntimeError(
                "fully_shard: a backward pass ran on tensors computed from the root's "
                "outputs outside its forward (a chunked loss), but no backward pass reached "
                "the root's outputs before this forward, so the groups before them never got "
                "their gradients reduced; backward through the root's outputs too (e.g. "
                "hidden.backward(hidden_detached.grad)), or call finalize_backward() on the "
                "root after the last pass"
            )
        if context.spmd_typed:
            refuse_spmd_type_checking()
        context.root_in_forward = True
        context.runs_outside = 0
        if context.finalizing is not None:
            # finalize_backward(async_op=True) whose handle was not waited on: its reduces
            # must land before this iteration's gradients.
            context.finalizing()
        if context.settings.post_optim_event is not None:
            # The optimizer step recorded this event: the gathers must see its writes.
            context.settings.post_optim_event.wait()
            context.settings = dataclasses.replace(context.settings, post_optim_event=None)
        # Gradient shards nobody holds any more (zero_grad set them to None) go back now,
        # not after this forward and backward (FSDP2 holds none across steps either).
        for state in context.states:
            if state.group is not None:
                state.group.release_unused_gradients()
        context.last_forward_order = context.forward_order
        context.forward_order = []

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self._modules_done.add(id(module))
        recompute = in_backward()  # activation checkpointing: backward reads these next
        needed = len(self.modules) if recompute else self._modules_needed
        if len(self._modules_done) < needed:
            return output  # a list group reshards after its last module
        context = self.context
        if self.is_root and not recompute and context is not None:
            # A list group whose other modules run outside the root's forward (a chunked
            # loss: `fully_shard([norm, head])`, `head` called per chunk after forward)
            # finishes its forward with the root's: its backward starts at the root's outputs.
            for state in context.states:
                if state is not self and state.training_state is TrainingState.FORWARD:
                    output = state._finish_forward(output, recompute=False)
            context.root_in_forward = False
        output = self._finish_forward(output, recompute)
        if self.is_root and not recompute and context is not None and torch.is_grad_enabled():
            output = hook_outputs(output, context.reach_root_output, context.open_root_output)
        if self.mp_policy.output_dtype is not None:
            output = cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _finish_forward(self, output: Any, recompute: bool) -> Any:
        """The end of a run's forward: reshard, record its place, hook its outputs."""
        self._modules_done = set()
        context = self.context
        if recompute:
            self._recomputing = False
        else:
            self._to(TrainingState.IDLE)
        # Only forwards that a backward will follow (not an eval loop, not a recompute).
        recorded = torch.is_grad_enabled() and not recompute
        if context is not None and self.group is not None and recorded:
            if context.root_in_forward or self.is_root:
                self._post_forward_positions.append(len(context.post_forward_order))
                context.post_forward_order.append(self)
            else:  # a run outside the root's forward: its backward prefetches nothing
                self._post_forward_positions.append(-1)
        after = self.config.reshard_after_forward
        if self.group is not None and after and not recompute:
            with profiler_range(f"FSDP::post_forward({self.group.label})"):
                self.group.reshard(keep_part=type(after) is int)
        if torch.is_grad_enabled() and self.group is not None:
            started = [False]  # this run's backward (its outputs get several gradients)
            output = hook_outputs(output, lambda grad: self._pre_backward(grad, started))
        return output

    def _forward_targets(self, position: int) -> Sequence[FSDPState]:
        """The groups to gather next in forward.

        Set explicitly, or the one after this group's position in the previous forward, if
        this group held the same position there.
        """
        if self.config.forward_prefetch is not None:
            return self.config.forward_prefetch
        last = self.context.last_forward_order if self.context else []
        if position + 1 < len(last) and last[position] is self:
            return [last[position + 1]]
        return []

    def _backward_targets(self) -> Sequence[FSDPState]:
        """The groups to gather next in backward.

        Set explicitly, or the one that finished forward just before this group's latest
        forward run not yet backpropagated.
        """
        if self.config.backward_prefetch is not None:
            return self.config.backward_prefetch
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
            if when == "backward" and not target.config.unshard_in_backward:
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
        self._to(TrainingState.PRE_BACKWARD)
        self._num_backward_runs_open += 1
        with profiler_range(f"FSDP::pre_backward({self.group.label})"):
            if self.config.unshard_in_backward:
                self.group.unshard()
                self.group.wait_for_unshard()
            self._prefetch(self._backward_targets(), "backward")
        return grad

    def post_backward(self) -> None:
        """Reshards the group, collects its gradients and starts its reduce-scatter."""
        if self.group is None:
            return
        self._to(TrainingState.POST_BACKWARD)
        self._recomputing = False
        self._num_post_backwards += 1
        self._num_backward_runs_open = max(0, self._num_backward_runs_open - 1)
        group, context, config = self.group, self.context, self.config
        assert context is not None
        with profiler_range(f"FSDP::post_backward({group.label})"):
            # The gathered parameters go first: the gradient buffer filled next is as large,
            # and both at once (with the gradients and the next group's prefetch) would be
            # the step's peak. The gradients stay reachable through the unsharded objects.
            if config.reshard_after_backward and not self._num_backward_runs_open:
                group.reshard()
            if config.requires_gradient_sync:
                # Finish the reduces in flight before this group's gradient buffer is filled,
                # so that their buffers are freed first: one group's gradients at a time.
                self._limit_reduces_in_flight(context)
            group.collect_gradients()
            if not config.requires_gradient_sync:
                self.needs_reduce = True
                return
            self.needs_reduce = False
            if group.has_reduce:
                # A reduce from a backward that was not the last (set_is_last_backward):
                # finish it first, so that this one adds to its gradients.
                finish_reduces([self])
            self._limit_reduces_in_flight(context)
            group.reduce(config, async_op=True)
            context.reducing.append(self)

    def _limit_reduces_in_flight(self, context: Context) -> None:
        while len(context.reducing) >= self.config.max_reduces_in_flight:
            context.reducing.pop(0).wait_for_reduce()

    def post_backwards_under_root(self) -> list[Callable[[], None] | None]:
        """Each FSDP state's post-backward under this state's root (None: no parameters)."""
        states = self.context.states if self.context is not None else states_under(self.modules)
        return [s.post_backward if s.group is not None else None for s in states]

    def end_of_iteration(self) -> None:
        """The end-of-backward work, run by a caller after backward (a pipeline stage)."""
        if self.context is not None:
            self._end_of_backward()

    def wait_for_reduce(self) -> None:
        if self.group is not None:
            self.group.wait_for_reduce(self.config)

    def _end_of_backward(self) -> None:
        context = self.context
        assert context is not None
        # A pass that did not reach the root's outputs, after groups ran outside the root's
        # forward (a chunked loss's chunk), ends like a manually finalized one: only the
        # groups it reached reduce; a later pass through the root's outputs ends the
        # iteration. (A loss that never uses the root's outputs keeps the usual ending.)
        partial = (
            context.root_output_open
            and context.runs_outside > 0
            and not context.settings.manual_finalization
        )
        manual = context.settings.manual_finalization or partial
        context.partial_passes += int(partial)
        with profiler_range("FSDP::end_of_backward"):
            for state in context.states:
                if state.needs_post_backward(manual=manual):
                    state.close_backward_runs()
                    state.post_backward()
                elif state.group is not None and state.config.reshard_after_backward:
                    state.group.reshard()  # e.g. prefetched but never run
            if manual:  # the iteration stays open until finalize(): only this pass ends
                context.manual_active = not partial
                context.callback_queued = False
                for state in context.states:
                    state.end_backward_pass()
                return
            if context.settings.is_last_backward:
                finish_reduces(context.states)
                context.reducing = []
            context.post_forward_order = []
            context.callback_queued = False
            context.partial_passes = 0
            for state in context.states:
                state.reset()


_WHY_REFUSED = {
    (_F, _PRE): "backward reached it before its forward finished",
    (_F, _POST): "backward reached it before its forward finished",
    (_PRE, _F): "a forward ran while its backward had not ended",
    (_POST, _F): "a forward ran while its backward had not ended",
}


def finish_reduces(states: Sequence[FSDPState]) -> None:
    """Waits for the states' pending reduces and hands out their sharded gradients.

    Every rank calls it for the same groups in the same order (it runs a small collective).
    """
    pending = [s for s in states if s.group is not None and s.group.has_reduce]
    for state in pending:
        state.wait_for_reduce()
    by_mesh: dict[int, list[FSDPState]] = {}
    for state in pending:
        assert state.group is not None
        by_mesh.setdefault(id(state.group.mesh), []).append(state)
    for same_mesh in by_mesh.values():
        groups = [s.group for s in same_mesh if s.group is not None]
        for state, group, used in zip(same_mesh, groups, used_anywhere(groups), strict=True):
            group.assign_gradients(used, unused_too=state.config.reduce_scatter_unused_params)
