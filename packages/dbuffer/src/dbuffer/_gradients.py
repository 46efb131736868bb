"""A DBuffer's gradient pipeline: full gradients in, this rank's reduced shard out.

- One global gradient buffer holds every full gradient at its planned offset
  (`_grad_buffer.py`: initialized lazily, so it is never zeroed as a whole).
- `reduce_scatter` reduces it straight into `local`, this rank's S elements, whose views are
  the sharded gradients (`_shards.py`), then frees it. Where the comm reduces in place (gloo
  on CPU, one rank: `_comm.py`) it copies this rank's chunk out instead: one pass over S
  elements and no clone.
- `all_reduce` then reduces the shard over the replicate axis (HSDP).
- With a `HostShard` (CPU offload) `local` is a host tensor: the reduce writes a device-side
  shard, all-reduced there (HSDP), which lands in `local` at its first read (`_host_shard.py`).
- The one pending state is a reduce in flight: every other operation waits for it first,
  since the reduce reads the global buffer and writes `local`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dbuffer._checks import check_dtype, check_grad, check_name
from dbuffer._comm import OPS, ShardComm
from dbuffer._compat import profiler_range
from dbuffer._grad_buffer import FullGradBuffer
from dbuffer._handle import Handle
from dbuffer._host_shard import HostLanding, HostShard
from dbuffer._shards import ShardViews
from dbuffer._streams import current_stream, free_storage, record_event
from shard_planner import Layout

_PLAIN_TENSORS = {torch.Tensor, torch.nn.Parameter}  # what autograd hands out as gradients


def _check_op(op: object) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")


class Gradients:
    """The gradients of one DBuffer (its public gradient methods delegate here).

    Args:
        layout: The buffer's layout.
        shapes: Each tensor's shape.
        views: The buffer's shard views (the sharded gradients reuse their specs).
        comm: The shard axis's comm object.
        replicate_group: The replicate axis's group (HSDP), or None.
        dtype: The gradients' dtype (the buffer's).
        device: The compute device: the full gradients' (and `local`'s without `host`).
        check_freed: Guard the full-gradient views (see `FreeableBuffer`).
        host: Keep `local` in host memory (CPU offload), or None.
    """

    def __init__(
        self,
        layout: Layout,
        shapes: Mapping[str, torch.Size],
        views: ShardViews,
        comm: ShardComm,
        replicate_group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        device: torch.device,
        *,
        check_freed: bool,
        host: HostShard | None = None,
    ) -> None:
        self._shapes, self._views, self._comm = shapes, views, comm
        self._host = host
        # A reduced shard on the device not yet in `local` (host memory); None otherwise.
        self._landing: HostLanding | None = None
        self._replicate_group = replicate_group
        self._size, self.dtype, self.device = layout.shard_size, dtype, device
        self._full = FullGradBuffer(layout, dict(shapes), dtype, device, check_freed=check_freed)
        self._local: torch.Tensor | None = None
        self._pending: Handle | None = None
        self._sharded: dict[str, DTensor] = {}

    # -- the reduced shard --------------------------------------------------------------------

    @property
    def local(self) -> torch.Tensor:
        """This rank's reduced gradients (S elements), zeros when first made."""
        if self._landing is not None:
            self._land()
        if self._local is None:
            self._local = self._new_local().zero_()
        return self._local

    def _new_local(self) -> torch.Tensor:
        if self._host is not None:
            return self._host.empty(self._size, self.dtype, self.device)
        return torch.empty(self._size, dtype=self.dtype, device=self.device)

    def _overwritten_local(self) -> torch.Tensor:
        """`local`, made without zeroing when the caller writes every element."""
        if self._local is None:
            self._local = self._new_local()
        return self._local

    def _host_target(self, *, accumulate: bool) -> torch.Tensor:
        """The host `local` a landing writes (zeroed when first made, if it adds into it)."""
        if self._local is None:
            self._local = self._new_local()
            if accumulate:
                self._local.zero_()
        return self._local

    def _land(self) -> None:
        """Moves the device-side reduced shard into the host `local` (CPU offload)."""
        landing, self._landing = self._landing, None
        assert landing is not None
        landing.land(self._host_target(accumulate=landing.accumulate))

    @property
    def has_local(self) -> bool:
        """Whether the shard is allocated now."""
        return self._local is not None

    def sharded(self) -> dict[str, DTensor]:
        """Every tensor's sharded gradient, a DTensor viewing `local` (made once per shard)."""
        if not self._sharded:
            self._sharded = self._views.views_of(self.local)
        return self._sharded

    def release(self) -> None:
        """Drops the shard; views handed out keep their memory, new ones view a new shard."""
        self.wait()
        self._landing = None
        self._local = None
        self._sharded = {}

    def zero(self) -> None:
        """Zeroes the shard (one kernel) and forgets the full gradients (no kernel)."""
        self.wait()
        self._landing = None
        if self._local is not None:  # a shard not made yet is zeros when it is
            self._local.zero_()
        self._full.zero()

    def scale_(self, factor: float) -> None:
        """Multiplies the shard by `factor`."""
        value: object = factor  # callers may pass anything; check before use
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"scale_grad_ factor must be a number, got {factor!r}")
        if self._landing is not None:
            self._land()
        if self._local is not None:
            self._local.mul_(factor)

    # -- full gradients -----------------------------------------------------------------------

    def full_view(self, name: str) -> torch.Tensor:
        """`name`'s view of the global gradient buffer (its range zeroed on first use)."""
        check_name(name, self._shapes)
        self.wait()
        return self._full.view(name)

    def accumulate(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """Adds full gradients into the global buffer: one foreach copy, one foreach add."""
        given: tuple[object, object] = (names, grads)  # callers may pass anything
        if isinstance(given[0], str) or isinstance(given[1], torch.Tensor):
            raise TypeError(
                "accumulate_grads takes a list of names and a list of gradients; for one "
                "tensor use accumulate_grad(name, grad)"
            )
        names, grads = list(names), list(grads)
        if len(names) != len(grads):
            raise ValueError(f"accumulate_grads: {len(names)} names but {len(grads)} gradients")
        # Checked as whole lists (the engine passes every gradient of a group per step); the
        # per-tensor loop below only runs to name the culprit.
        shapes = self._shapes
        if not (
            {g.__class__ for g in grads} <= _PLAIN_TENSORS
            and set(names) <= shapes.keys()
            and [shapes[n] for n in names] == [g.shape for g in grads]
            and {g.device for g in grads} <= {self.device}
            and all(
                dtype.is_floating_point or dtype.is_complex for dtype in {g.dtype for g in grads}
            )
        ):
            for name, grad in zip(names, grads, strict=True):
                check_name(name, shapes)
                check_grad(name, grad, shapes[name], self.device)
        self.wait()
        if len(set(names)) < len(names):  # a name twice: add in order, one at a time
            for name, grad in zip(names, grads, strict=True):
                self._full.accumulate([name], [grad])
            return
        self._full.accumulate(names, grads)

    # -- collectives --------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether a reduce-scatter is in flight."""
        return self._pending is not None

    def wait(self) -> None:
        """Waits for a reduce-scatter in flight (a no-op when none is)."""
        if self._pending is not None:
            self._pending.wait()

    def reduce_scatter(
        self,
        *,
        op: Literal["avg", "sum"],
        divide_factor: float | None,
        reduce_dtype: torch.dtype | None,
        accumulate: bool,
        async_op: bool,
    ) -> Handle:
        """Reduces the global buffer into `local` (see `DBuffer.reduce_scatter`)."""
        _check_op(op)
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {accumulate!r}")
        reduce_dtype = check_dtype("reduce_dtype", reduce_dtype)
        self.wait()
        if self._landing is not None:  # an earlier reduce not read yet: add to it, or drop it
            if accumulate:
                self._land()
            self._landing = None
        grad = self._full.for_reduce()
        if divide_factor is not None:
            factor: object = divide_factor  # callers may pass anything; check before use
            if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
                raise ValueError(f"divide_factor must be a number > 0, got {divide_factor!r}")
            grad.div_(divide_factor)
            op = "sum"
        # In a reduce dtype the collective reads a cast copy and writes a temporary; both
        # stay referenced by the handle until the collective is done.
        send = grad if reduce_dtype in (None, self.dtype) else grad.to(reduce_dtype)
        temps = [] if send is grad else [send]
        out: torch.Tensor | None = None
        if not self._comm.reduces_in_place:
            host = self._host is not None  # the result stays on the device until it lands
            if send.dtype == self.dtype and not accumulate and not host:  # all overwritten
                out = self._overwritten_local()
            else:
                out = torch.empty(self._size, dtype=send.dtype, device=self.device)
                temps.append(out)
        works, result = self._comm.reduce_scatter(out, send, op=op, async_op=async_op)
        alloc_stream = current_stream(self.device)

        def finish() -> None:
            kept = None
            if self._host is not None:
                kept = result if result.dtype == self.dtype else result.to(self.dtype)
                if self._replicate_group is None:  # to host memory now (stream-ordered)
                    self._landing = HostLanding(kept, accumulate=accumulate)
                    self._landing.start(self._host_target(accumulate=accumulate))
                else:  # all-reduced on the device first; not in the full buffer freed below
                    if kept is result and result is not out:
                        kept = result.clone()
                    self._landing = HostLanding(kept, accumulate=accumulate)
            else:
                local = self.local if accumulate else self._overwritten_local()
                if result is not local:
                    if accumulate:
                        local.add_(result)
                    else:
                        local.copy_(result)
            # The temporaries were allocated on the issuing stream; order their reuse.
            for temp in temps:
                if temp is not kept:
                    free_storage(temp, alloc_stream)
            self._full.free()
            self._pending = None

        handle = Handle(works, device=self.device, event=record_event(self.device), then=finish)
        if async_op:
            self._pending = handle
        else:
            handle.wait()
        return handle

    def all_reduce(
        self, *, op: Literal["avg", "sum"], reduce_dtype: torch.dtype | None, async_op: bool
    ) -> Handle:
        """Reduces `local` over the replicate axis (see `DBuffer.all_reduce`)."""
        _check_op(op)
        reduce_dtype = check_dtype("reduce_dtype", reduce_dtype)
        self.wait()
        group = self._replicate_group
        if group is None:
            return Handle()
        landing = self._landing
        if landing is not None and landing.started:
            self._land()
            landing = None
        # What is reduced: the device-side shard still to land (CPU offload), a device copy
        # of the host shard, or `local` itself.
        if landing is not None:
            shard = landing.shard
        elif self._host is not None:
            shard = self.local.to(self.device, copy=True)
        else:
            shard = self.local
        want = reduce_dtype or self.dtype
        target = shard if shard.dtype == want else shard.to(want)
        with profiler_range("DBuffer::all_reduce"):
            work = dist.all_reduce(target, op=OPS[op], group=group, async_op=async_op)
        alloc_stream = current_stream(self.device)

        def finish() -> None:
            if target is not shard:
                shard.copy_(target)
                free_storage(target, alloc_stream)
            if landing is not None:
                landing.start(self._host_target(accumulate=landing.accumulate))
            elif shard is not self._local:
                self.local.copy_(shard)

        return Handle([work], device=self.device, event=record_event(self.device), then=finish)
