"""ParamGroup: the parameters of one `fully_shard` call, held in one DBuffer per dtype.

Between iterations each parameter is registered on its module(s) as an `nn.Parameter` whose
data is a RaggedShard DTensor over a view of its DBuffer's `local` (the optimizer steps them in
place, so the next all-gather sends the new values without a copy). `unshard()` gathers the
DBuffers and registers, in the same places, plain `nn.Parameter`s over the DBuffers' persistent
full views: the same objects every step, whose memory comes and goes underneath.

Gradients: after backward each unsharded parameter's gradient is added into its DBuffer's full
gradient buffer (one copy, or one add when accumulating micro-batches), the DBuffer
reduce-scatters the whole buffer into `local_grad`, and each sharded parameter's `.grad` is a
RaggedShard DTensor view of `local_grad`, accumulated across iterations until the user zeroes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, Handle
from fsdp_engine._compat import parameter_slots, post_accumulate_grad_hooks, profiler_range
from fsdp_engine._config import GroupConfig
from fsdp_engine._param import ManagedParam, same_layout
from ragged_placement import flat_range

if TYPE_CHECKING:
    from fsdp_engine._subclass import SubclassParam


@dataclass(eq=False)
class _Reduction:
    """A reduce issued whose gradients are not handed out yet (the buffers own its works)."""

    saved: dict[DBuffer, torch.Tensor]  # local_grad before the reduce, to add back
    buffers: list[DBuffer]  # the reduced ones: those holding a parameter that requires grad
    finished: bool = False  # waited for, HSDP all-reduced, hooks run


@dataclass(eq=False)
class ParamGroup:
    """The parameters of one `fully_shard` call (see the module docstring).

    Args:
        params: The group's parameters, each with its DBuffer already built.
        mesh: The group's mesh (1-D, or 2-D (replicate, shard) for HSDP).
        mp_policy: The mixed-precision policy.
        label: A name for profiler ranges and errors (the module's class name).
        subclass_params: Tensor-subclass parameters gathered by their own hooks
            (`_subclass.py`): frozen, outside the DBuffers, gathered and freed with them.
    """

    params: list[ManagedParam]
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    label: str
    subclass_params: list[SubclassParam] = field(default_factory=list)
    _unshard_handles: list[Handle] = field(default_factory=list)
    _reduction: _Reduction | None = None
    _received: set[ManagedParam] = field(default_factory=set)  # got a gradient since the reduce
    _reduce_op: Literal["avg", "sum"] = "avg"
    # Parameters without values: the group was materialized from the meta device by
    # `load_state_dict(assign=True)`, which has not assigned these (yet).
    unloaded: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._keep_groups: dict[DBuffer, dist.ProcessGroup] = {}
        # Per DBuffer, the dtype asked for it: param_dtype, or None where its parameters
        # keep their own (set by fully_shard).
        self.compute_dtypes: dict[DBuffer, torch.dtype | None] = {}
        # Per DBuffer, its parameters in group order: the per-step loops below walk these
        # lists doing attribute work only (no Python call per parameter).
        self.members: dict[DBuffer, list[ManagedParam]] = {}
        for param in self.params:
            self.members.setdefault(param.buffer, []).append(param)
        self.buffers = list(self.members)
        # (the module's parameter dict, name, parameter) for every place a parameter is
        # registered: swapping sharded and gathered parameters is one dict write each.
        self._slots = [
            (parameter_slots(module), attr, p) for p in self.params for module, attr in p.locations
        ]
        self._subclass_slots = [
            (parameter_slots(module), attr, p)
            for p in self.subclass_params
            for module, attr in p.locations
        ]

    def slots_in(
        self, modules: set[nn.Module]
    ) -> list[tuple[dict[str, nn.Parameter | None], str, ManagedParam]]:
        """The (parameter dict, name, parameter) registrations that live in `modules`."""
        wanted = {id(m) for m in modules}
        return [
            (parameter_slots(module), attr, p)
            for p in self.params
            for module, attr in p.locations
            if id(module) in wanted
        ]

    # -- unshard / reshard --------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        """Whether the group's buffers hold gathered memory (their state, read here).

        They are gathered and freed together (with the tensor-subclass parameters), so the
        first one speaks for all.
        """
        if self.buffers:
            return self.buffers[0].is_unsharded
        return self.subclass_params[0].is_unsharded

    def _compute_dtype(self, buffer: DBuffer) -> torch.dtype | None:
        """What the buffer is gathered in: None for its own dtype.

        param_dtype, unless `param_dtype_override_fn` kept the buffer's parameters in their
        own dtype (`_param_dtypes.py`); read against the buffer's dtype now, so a group
        converted after fully_shard (`.to(dtype)`) still casts what it should.
        """
        dtype = self.compute_dtypes.get(buffer, self.mp_policy.param_dtype)
        if dtype is None or not buffer.dtype.is_floating_point or dtype == buffer.dtype:
            return None
        return dtype

    def unshard(self, *, async_op: bool = False) -> list[Handle]:
        """Gathers every DBuffer (a no-op while unsharded); returns the handles to wait on."""
        if self.is_unsharded:
            return self._unshard_handles
        if self.unloaded:
            raise RuntimeError(
                f"fully_shard: {self.label}'s parameters {sorted(self.unloaded)} have no "
                f"values: load_state_dict(assign=True) materialized the group from the meta "
                f"device but assigned only some of its parameters; assign all of them"
            )
        with profiler_range(f"FSDP::unshard({self.label})"):
            self._unshard_handles = [
                buffer.unshard(dtype=self._compute_dtype(buffer), async_op=async_op)
                for buffer in self.buffers
            ]
            self._unshard_handles += [
                param.unshard(async_op=async_op) for param in self.subclass_params
            ]
        return self._unshard_handles

    def wait_for_unshard(self) -> None:
        """Waits for the gathers and registers the unsharded parameters."""
        if self._unshard_handles:
            with profiler_range(f"FSDP::wait_for_unshard({self.label})"):
                for handle in self._unshard_handles:
                    handle.wait()
        self._unshard_handles = []
        for param in self.params:
            if param.unsharded is None:
                dtype = self._compute_dtype(param.buffer)
                full = param.buffer.full(param.name, dtype=dtype)
                if param.parallel is not None:
                    full = param.parallel.wrap(full)
                param.unsharded = nn.Parameter(full, requires_grad=param.requires_grad)
                param.compute_dtype = dtype
        for slots, attr, param in self._slots:
            held = slots[attr]
            if held is not param.sharded and held is not param.unsharded:
                raise RuntimeError(
                    f"fully_shard: {self.label}'s parameter {param.name!r} was replaced by a "
                    f"new tensor after the first forward; assign it before the first forward "
                    f"(it is adopted then), or write into it in place (with torch.no_grad(): "
                    f"param.copy_(value)) or load_state_dict(...)"
                )
            slots[attr] = param.unsharded
        for slots, attr, subclass_param in self._subclass_slots:
            slots[attr] = subclass_param.gathered()

    def set_post_forward_parts(self, parts: int) -> None:
        """After forward, keep 1/`parts` of each gathered buffer (`reshard_after_forward=int`).

        Backward then gathers over the `parts` consecutive ranks of this rank's shard axis
        only (tensor-subclass parameters are freed whole and gathered again). The process
        groups are made here, once per set of ranks, by their members only.
        """
        self._keep_groups = {}
        for buffer in self.buffers:
            ranks = dist.get_process_group_ranks(buffer.mesh.get_group(buffer.shard_axis))
            if len(ranks) % parts:
                raise ValueError(
                    f"reshard_after_forward={parts} must divide the size {len(ranks)} of "
                    f"{self.label}'s shard axis; valid: "
                    f"{[k for k in range(1, len(ranks) + 1) if len(ranks) % k == 0]}"
                )
            index = buffer.mesh.get_local_rank(buffer.shard_axis)
            start = index // parts * parts
            self._keep_groups[buffer] = _process_group(tuple(ranks[start : start + parts]))

    def reshard(self, *, keep_part: bool = False) -> None:
        """Frees the gathered memory and registers the sharded parameters again.

        With `keep_part` (after forward, `reshard_after_forward=k`) each buffer keeps its
        1/k share for backward's smaller gather (see `set_post_forward_parts`).
        """
        if self.is_unsharded:
            keep = self._keep_groups if keep_part else {}
            for buffer in self.buffers:
                buffer.reshard(keep_group=keep.get(buffer))
            for subclass_param in self.subclass_params:
                subclass_param.reshard()
            self._unshard_handles = []
        for slots, attr, param in self._slots:
            slots[attr] = param.sharded
        for slots, attr, subclass_param in self._subclass_slots:
            slots[attr] = subclass_param.sharded

    # -- gradients ----------------------------------------------------------------------------

    def collect_gradients(self) -> None:
        """Moves the unsharded parameters' gradients into their DBuffers' gradient buffers.

        One foreach copy (or add, when accumulating) per DBuffer.
        """
        for buffer, members in self.members.items():
            # Comprehensions, not a loop of calls: this runs for every parameter every step.
            pairs = [(p, p.unsharded.grad) for p in members if p.unsharded is not None]
            got = [(p, grad) for p, grad in pairs if grad is not None]
            if not got:
                continue
            grads = [g if p.parallel is None else p.parallel.local_grad(g) for p, g in got]
            buffer.accumulate_grads([p.name for p, _ in got], grads)
            for param, _ in got:
                param.unsharded.grad = None  # type: ignore[union-attr]
            self._received.update([p for p, _ in got])

    def reduce(self, config: GroupConfig, *, async_op: bool) -> None:
        """Reduce-scatters every DBuffer's gradients (the sharded `.grad`s are set later).

        Sharded gradients that the user has not zeroed (`.grad` not None) are kept and the
        new ones added to them: `local_grad` is saved, the reduce overwrites it, and the
        saved part is added back once the reduce is done.
        """
        received = self._received
        # A buffer of frozen parameters only has no gradient to reduce (and an integer one
        # could not be averaged); requires_grad is the model's, the same on every rank.
        trainable: dict[DBuffer, list[ManagedParam]] = {}
        for buffer, all_members in self.members.items():
            members = [p for p in all_members if p.sharded.requires_grad]
            if members:
                trainable[buffer] = members
        for buffer, members in trainable.items():
            if received.isdisjoint(members):
                # No gradient reached this buffer on this rank; it still takes part in the
                # collective (other ranks may have some), with zeros.
                buffer.full_grad(buffer.names[0])
        saved: dict[DBuffer, torch.Tensor] = {}
        for buffer, members in trainable.items():
            kept = [p for p in members if p.sharded.grad is not None]
            if kept:
                # Zeroed first (the reduce overwrites local_grad anyway) so that what is
                # added back holds only the gradients the user kept.
                for param in members:
                    if param.sharded.grad is None:
                        buffer.sharded_grad(param.name).to_local().zero_()
                saved[buffer] = buffer.local_grad.clone()
        summed = config.divide_factor is not None or config.force_sum_reduction
        # With a factor: gradients divided once by it, then summed over both mesh axes.
        self._reduce_op = "sum" if summed else "avg"
        with profiler_range(f"FSDP::reduce_scatter({self.label})"):
            for buffer in trainable:
                factor = config.divide_factor
                if factor is None and summed:
                    factor = float(_data_parallel_size(buffer))
                reduce_dtype = self.mp_policy.reduce_dtype or self._compute_dtype(buffer)
                # The buffer holds the pending work (`wait_for_reduce` waits for it).
                buffer.reduce_scatter(
                    op="sum" if factor is not None else "avg",
                    divide_factor=factor,
                    reduce_dtype=reduce_dtype,
                    async_op=async_op,
                )
        self._reduction = _Reduction(saved, list(trainable))

    def wait_for_reduce(self, config: GroupConfig) -> None:
        """Waits for the reduce-scatter and finishes the group's reduction.

        Then all-reduces over the replicate axis (HSDP), runs the all-reduce hook and adds
        back the gradients the user kept.
        """
        reduction = self._reduction
        if reduction is None or reduction.finished:
            return
        for buffer in reduction.buffers:
            with profiler_range(f"FSDP::wait_for_reduce({self.label})"):
                buffer.wait_for_reduce()
            if config.requires_all_reduce and buffer.replicate_axis is not None:
                buffer.all_reduce(
                    op=self._reduce_op, reduce_dtype=self.mp_policy.reduce_dtype
                ).wait()
            if config.all_reduce_hook is not None:
                config.all_reduce_hook(buffer.local_grad)
            old = reduction.saved.get(buffer)
            if old is not None:
                buffer.local_grad.add_(old)
        reduction.finished = True

    def release_unused_gradients(self) -> None:
        """Releases each DBuffer's gradient shard when no parameter's `.grad` points into it.

        The next reduce allocates a new one; gradients a user still holds keep their memory.
        """
        if self._reduction is not None:
            return
        for buffer, members in self.members.items():
            if not [p for p in members if p.sharded.grad is not None and p.sharded.requires_grad]:
                buffer.release_grad()

    @property
    def has_reduce(self) -> bool:
        """Whether a reduce was issued whose gradients are not handed out yet."""
        return self._reduction is not None

    def received(self) -> list[bool]:
        """Per trainable parameter: whether it got a gradient on this rank since the reduce."""
        return [p in self._received for p in self.params if p.sharded.requires_grad]

    def assign_gradients(self, used_anywhere: list[bool], *, unused_too: bool) -> None:
        """Points each trainable sharded parameter's `.grad` at its reduced gradient.

        Args:
            used_anywhere: Per trainable parameter, whether any rank produced a gradient for
                it. Parameters no rank used keep `.grad` as it was (None after zero_grad),
                as in single-process training, unless unused parameters are reduced too.
            unused_too: Hand out (zero) gradients of parameters no rank used as well.
        """
        trainable = [p for p in self.params if p.sharded.requires_grad]
        reduced_by_buffer = {buffer: buffer.sharded_grads() for buffer in self.buffers}
        # Comprehensions, not a loop of calls: this runs for every parameter every step.
        assigned = [
            p for p, used in zip(trainable, used_anywhere, strict=True) if used or unused_too
        ]
        for param in assigned:
            reduced = reduced_by_buffer[param.buffer][param.name]
            current = param.sharded.grad
            if current is None:
                param.sharded.grad = reduced
            elif current is not reduced:  # a gradient the user set: accumulate into it
                current.add_(reduced)
        self._received.clear()
        self._reduction = None
        # Hooks registered on the sharded parameters (optimizer in backward) see the sharded
        # gradient, as in FSDP2; autograd ran none, as it only saw the gathered parameters.
        for sharded, hooks in post_accumulate_grad_hooks([p.sharded for p in assigned]):
            for hook in hooks:
                hook(sharded)


def adopt_assigned(
    group: ParamGroup, modules: set[nn.Module], source: str = "load_state_dict(assign=True)"
) -> None:
    """Takes in the values `load_state_dict(assign=True)` put in place of sharded parameters.

    nn.Module's assign replaces the registered parameter objects, but the group's parameters
    must stay views of its DBuffers (and gathers read those): so each assigned tensor's values
    are copied into the group's own sharded parameter, which is registered again. A tensor is
    taken as a DTensor with the parameter's mesh and placements (what `model.state_dict()`
    gives, and torch's `distribute_tensor` with those placements), or, for a parameter
    without tensor parallelism, as the full tensor (each rank keeps its rows). A group built
    on the meta device gets its memory on the assigned tensors' device first. A
    tensor-subclass parameter takes the assigned DTensor itself (`SubclassParam.adopt`).

    Args:
        group: The group whose modules were loaded.
        modules: The modules whose parameters the load has reached (a subtree).
        source: What put the tensors in place, for errors.
    """
    assigned = [
        (slots, attr, param, _assigned_values(param, slots[attr], source))
        for slots, attr, param in group.slots_in(modules)
        if slots[attr] is not param.sharded and slots[attr] is not param.unsharded
    ]
    wanted = {id(m) for m in modules}
    subclass_assigned = [
        (slots, attr, p, slots[attr])
        for p in group.subclass_params
        for module, attr in p.locations
        if id(module) in wanted and (slots := parameter_slots(module))[attr] is not p.sharded
    ]
    real = [values.device for *_, values in assigned if values.device.type != "meta"]
    if real and group.params[0].buffer.device.type == "meta":
        # Re-registers the sharded parameters everywhere: the assigned values are held above.
        move_storage(group, lambda t: torch.empty_like(t, device=real[0]))
        group.unloaded = {p.name for p in group.params}
    for slots, attr, param, values in assigned:
        with torch.no_grad():
            sharded_param(param).to_local().copy_(values)
        group.unloaded.discard(param.name)
        slots[attr] = param.sharded
    for slots, attr, subclass_param, value in subclass_assigned:
        subclass_param.adopt(value)
        slots[attr] = subclass_param.sharded


def sharded_param(param: ManagedParam) -> DTensor:
    """The sharded parameter, as the DTensor it is (an nn.Parameter over a DTensor)."""
    sharded = param.sharded
    assert isinstance(sharded, DTensor)
    return sharded


def _assigned_values(param: ManagedParam, new: object, source: str) -> torch.Tensor:
    """This rank's piece of the tensor assigned to `param`, checked against its layout.

    A DTensor on the parameter's mesh with other placements is redistributed to them (one
    collective, on every rank alike: the assignment is the same program on every rank).
    """
    sharded = sharded_param(param)
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"{source} assigned a {type(new).__name__} to {param.name!r}")
    if new.dtype != sharded.dtype:
        raise ValueError(
            f"{source} gives {param.name!r} dtype {new.dtype}, but "
            f"fully_shard's group holds it in {sharded.dtype}: cast the state dict first, or "
            f"load with assign=False"
        )
    if isinstance(new, DTensor):
        if new.device_mesh == sharded.device_mesh and new.shape == sharded.shape:
            new = new.redistribute(sharded.device_mesh, sharded.placements)
        if not same_layout(new, sharded):
            raise ValueError(
                f"{source} gives {param.name!r} as a DTensor of shape "
                f"{tuple(new.shape)} with placements {tuple(new.placements)}; the sharded "
                f"parameter is {tuple(sharded.shape)} with {tuple(sharded.placements)} on its "
                f"mesh: build it with distribute_tensor(full, mesh, those placements), or pass "
                f"the full tensor"
            )
        return new.to_local()
    if new.shape != sharded.shape or param.parallel is not None:
        raise ValueError(
            f"{source} gives {param.name!r} a tensor of shape "
            f"{tuple(new.shape)}; expected the full {tuple(sharded.shape)}"
            + (" as a DTensor (it is tensor parallel)" if param.parallel is not None else "")
        )
    lo, hi = flat_range(sharded)
    return new.detach().reshape(-1)[lo:hi]


_PROCESS_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
# The default group the cached ones were made under (held, so its identity is not reused).
_MADE_UNDER: list[object] = [None]


def _process_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group of `ranks`, made once (by its members only) and then reused.

    Made again after the default group was destroyed and created anew (a process that
    re-initializes torch.distributed): the cached ones died with the old one.
    """
    world = dist.group.WORLD
    if _MADE_UNDER[0] is not world:
        _PROCESS_GROUPS.clear()
        _MADE_UNDER[0] = world
    group = _PROCESS_GROUPS.get(ranks)
    if group is None:
        made = dist.new_group(list(ranks), use_local_synchronization=True)
        assert made is not None  # this rank is among `ranks`
        group = _PROCESS_GROUPS[ranks] = made
    return group


def _data_parallel_size(buffer: DBuffer) -> int:
    """Ranks a buffer's gradients are averaged over: its shard axis times its replicate axis."""
    size = buffer.mesh.size(buffer.shard_axis)
    if buffer.replicate_axis is not None:
        size *= buffer.mesh.size(buffer.replicate_axis)
    return size


def used_anywhere(groups: list[ParamGroup]) -> list[list[bool]]:
    """ORs each group's `received()` over every rank of the groups' (common) mesh.

    One small all-reduce per mesh axis serves all the groups together.
    """
    flags = [group.received() for group in groups]
    mine = [f for group in flags for f in group]
    if not mine:  # no trainable parameters (frozen tensor-subclass ones only)
        return flags
    mesh = groups[0].mesh
    axes = [axis for axis in range(mesh.ndim) if mesh.size(axis) > 1]
    if not axes:
        return flags
    device = next(group.params[0].buffer.device for group in groups if group.params)
    # Used here means used somewhere: then this rank only takes part in the all-reduce.
    # Reading the result would make the host wait for the device at every step.
    used_here = all(mine)
    if used_here:
        flat = torch.ones(len(mine), dtype=torch.int32, device=device)
    else:
        flat = torch.tensor(mine, dtype=torch.int32, device=device)
    for axis in axes:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
    if used_here:
        return flags
    values = flat.tolist()
    starts = [0]
    for group in flags:
        starts.append(starts[-1] + len(group))
    return [[v != 0 for v in values[a:b]] for a, b in itertools.pairwise(starts)]


def move_storage(group: ParamGroup, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Applies `fn` (a device / dtype conversion) to every DBuffer and rebinds the params.

    Tensor-subclass parameters are converted apart (`SubclassParam.convert`), first: a
    conversion that would change their class is refused before anything moves.
    """
    group.reshard()
    for buffer in group.buffers:
        buffer.apply_(fn)
    for param in group.params:
        param.sharded.grad = None
        new = nn.Parameter(param.buffer.sharded(param.name), requires_grad=param.requires_grad)
        # The parameter object stays the same (an optimizer or a user may hold it); only
        # its contents become the DTensor over the new storage.
        torch.utils.swap_tensors(param.sharded, new)  # type: ignore[no-untyped-call]
        param.unsharded = None  # made again over the new full views at the next unshard
