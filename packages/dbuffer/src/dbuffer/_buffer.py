"""DBuffer: a group of tensors living in one planned, evenly sharded buffer.

Memory model (see docs/architecture.md, "DBuffer"):
- `local` is this rank's S elements (one allocation); each tensor's sharded piece is a view of
  it and is exposed as a RaggedShard DTensor (`sharded(name)`, `_shards.py`).
- `unshard()` all-gathers `local` straight into one global buffer of m * S elements; each
  tensor's unsharded form is a view of that buffer at its planned offset (`full(name)`). The
  views are made once and keep their identity: `reshard()` frees the storage under them
  (resize to 0) and the next `unshard()` re-allocates it, so no per-tensor allocation and no
  copy-in / copy-out ever happens. With `dtype=` (mixed precision) the local shard is cast
  once into this rank's chunk of the global buffer; that cast is the only elementwise pass.
- How bytes move (native collectives, gloo in place, one rank) is chosen once per buffer
  (`_comm.py`); the gradients (global gradient buffer, reduce-scatter into `local_grad`,
  HSDP all-reduce) are their own pipeline (`_gradients.py`), which this class fronts.
- Freed memory: `full()` raises while resharded, as does a backward that needs a freed view
  (autograd's version error); `check_freed` checks every op on a view too (`_freeable.py`,
  `_views.py`). On CUDA, frees and Handles order streams by explicit waits (`_streams.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dbuffer._checks import (
    BlockRows,
    DeprecatedAxisNames,
    check_axis,
    check_dtype,
    check_name,
    renamed_keyword,
)
from dbuffer._comm import ShardComm, comm_for
from dbuffer._entries import plan_entries
from dbuffer._freeable import FreeableBuffer, check_freed_default
from dbuffer._gradients import Gradients
from dbuffer._handle import Handle
from dbuffer._host_shard import HostShard, check_host_shard, compute_device
from dbuffer._shards import ShardViews, held_range
from dbuffer._streams import record_event
from dbuffer._wire import BlockFloat8, Float8Wire
from shard_planner import Layout


class DBuffer(DeprecatedAxisNames):
    """Tensors of one dtype and device, planned into one evenly sharded buffer.

    Args:
        tensors: (name, tensor) pairs, contiguous, one dtype and one device; their values are
            copied into the local shard once, at construction. A tensor may be a DTensor
            sharded over other axes of the same device mesh (tensor or expert parallel, with
            Shard(d) dividing dim d evenly, or Replicate): its local piece is what this buffer
            holds (`full`, gradients and `copy_` have the piece's shape), and `sharded(name)`
            is a DTensor over `mesh`'s axes followed by the tensor's (`_outer.py`).
        mesh: The device mesh (with named axes when a tensor is a DTensor).
        shard_axis: Mesh axis the buffer is sharded over.
        replicate_axis: Mesh axis it is replicated over (HSDP), or None.
        block_rows: Rows per unshardable block: one int for all, a mapping by name (missing
            names get 1), or a function of (name, tensor) with the tensor as given (as
            `fully_shard`'s of (fqn, param)). A function whose second parameter is named
            `shape` gets the shape instead (the former contract; deprecated).
        num_shard_dims: How many leading dims a shard boundary may cut (a row is then
            `shape[num_shard_dims:]`): one int for all or a mapping by name (missing names get
            1). For a fused expert weight of shape (E, H, F), 2 lets shards cut inside an
            expert, one matrix row of F elements at a time, where 1 keeps each expert whole.
        align_bytes: Every rank's chunk starts at a multiple of this many bytes.
        layout: A precomputed layout for exactly these tensors (names, sizes, world size).
        check_freed: Make every op on a `full` / `full_grad` view check that its memory is
            there and raise a clear error if not (about 10 us per op; for debugging). None:
            on when the environment has `DBUFFER_CHECK_FREED=1`. Off, reading a view held
            across a `reshard()` is undefined (as for FSDP2's unsharded parameters), but
            `full()` and autograd's saved views still raise while freed.
        gather_format: Gather in a low-precision wire format (`BlockFloat8`: fp8 codes and
            one scale per block, `_wire.py`); the full views stay in the unshard dtype.
        host_shard: `HostShard()`: keep `local` and `local_grad` in host memory and gather
            and reduce on the mesh's device (CPU offload, `_host_shard.py`). The tensors may
            then be on the host or on that device.
        shard_dim: Deprecated name of `shard_axis` (a mesh axis, not a tensor dim).
        replicate_dim: Deprecated name of `replicate_axis`.

    Example:
        >>> buf = DBuffer([("w", w), ("b", b)], mesh, block_rows={"w": 32})
        >>> buf.unshard().wait()
        >>> buf.full("w") is buf.full("w")
        True
    """

    def __init__(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        mesh: DeviceMesh,
        *,
        shard_axis: int | None = None,
        replicate_axis: int | None = None,
        block_rows: BlockRows = 1,
        num_shard_dims: int | Mapping[str, int] = 1,
        align_bytes: int = 16,
        layout: Layout | None = None,
        check_freed: bool | None = None,
        gather_format: BlockFloat8 | None = None,
        host_shard: HostShard | None = None,
        shard_dim: int | None = None,
        replicate_dim: int | None = None,
    ) -> None:
        shard_axis = renamed_keyword("shard_dim", shard_dim, "shard_axis", shard_axis)
        replicate_axis = renamed_keyword(
            "replicate_dim", replicate_dim, "replicate_axis", replicate_axis
        )
        if check_freed is not None and not isinstance(check_freed, bool):
            raise TypeError(f"check_freed must be a bool or None, got {check_freed!r}")
        self.check_freed = check_freed_default() if check_freed is None else check_freed
        self.mesh = mesh
        self.shard_axis = check_axis("shard_axis", 0 if shard_axis is None else shard_axis, mesh)
        self.replicate_axis = (
            None if replicate_axis is None else check_axis("replicate_axis", replicate_axis, mesh)
        )
        if self.replicate_axis == self.shard_axis:
            raise ValueError(
                f"replicate_axis and shard_axis must differ, both are {self.shard_axis}"
            )
        entries = plan_entries(
            tensors,
            mesh,
            mesh.size(self.shard_axis),
            block_rows=block_rows,
            num_shard_dims=num_shard_dims,
            align_bytes=align_bytes,
            layout=layout,
        )
        self._outer, self._shapes, self.layout = entries.outer, entries.shapes, entries.layout
        tensors = entries.tensors
        first = tensors[0][1]
        self.host_shard = check_host_shard(host_shard, gather_format)
        self.dtype = first.dtype
        # The compute device: where the gathered tensors and full gradients live (and the
        # shards too, without a host shard).
        self.device = first.device if host_shard is None else compute_device(first.device, mesh)
        self._rank = mesh.get_local_rank(self.shard_axis)
        group = mesh.get_group(self.shard_axis)
        self._comm: ShardComm = comm_for(group, self.device)
        if gather_format is not None and not isinstance(gather_format, BlockFloat8):
            raise TypeError(f"gather_format must be a BlockFloat8 or None, got {gather_format!r}")
        uneven = [name for name, spec in self._outer.items() if spec.uneven]
        if gather_format is not None and uneven:
            raise ValueError(
                f"gather_format cannot gather {uneven[0]!r}: it is split unevenly over its "
                f"other mesh axes, and fp8 blocks need one plan on every rank; gather it plainly"
            )
        self._wire = (
            None
            if gather_format is None
            else Float8Wire(gather_format, self.layout, self._shapes, self._rank)
        )
        if host_shard is None:
            self.local = torch.zeros(self.layout.shard_size, dtype=self.dtype, device=self.device)
        else:  # in host memory, pinned as asked
            self.local = host_shard.empty(self.layout.shard_size, self.dtype, self.device).zero_()
        self.copy_(dict(tensors))
        self._views = ShardViews(
            self.layout, self._shapes, self._outer, mesh, self.shard_axis, self.local
        )
        # Global (unsharded) buffers by dtype, and the unshards still in flight into them.
        self._global: dict[torch.dtype, FreeableBuffer] = {}
        self._pending_unshards: dict[torch.dtype, Handle] = {}
        self._unsharded = False  # some global buffer holds memory (read on every hook)
        # What `reshard(keep_group=...)` kept of each global buffer, and the comm to gather
        # it with at the next unshard.
        self._kept: dict[torch.dtype, tuple[ShardComm, torch.Tensor]] = {}
        self._grads = self._new_gradients()

    def _new_gradients(self) -> Gradients:
        axis = self.replicate_axis
        replicas = None if axis is None or self.mesh.size(axis) == 1 else self.mesh.get_group(axis)
        return Gradients(
            self.layout,
            self._shapes,
            self._views,
            self._comm,
            replicas,
            self.dtype,
            self.device,
            check_freed=self.check_freed,
            host=self.host_shard,
        )

    # -- sizes and names ----------------------------------------------------------------------

    @property
    def shard_size(self) -> int:
        """Elements per rank, S."""
        return self.layout.shard_size

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in the caller's order."""
        return tuple(self._shapes)

    # -- sharded views ------------------------------------------------------------------------

    def sharded(self, name: str) -> DTensor:
        """Tensor `name` as a RaggedShard DTensor whose local tensor is a view of `local`."""
        check_name(name, self._shapes)
        return self._views.of_local[name]

    def sharded_grad(self, name: str) -> DTensor:
        """The reduced gradient of `name`, a RaggedShard DTensor viewing `local_grad`."""
        check_name(name, self._shapes)
        return self._grads.sharded()[name]

    def sharded_grads(self) -> dict[str, DTensor]:
        """`sharded_grad(name)` of every tensor, by name (built together, in one pass).

        Example:
            >>> grads = buf.sharded_grads()
            >>> grads["w"] is buf.sharded_grad("w")
            True
        """
        return dict(self._grads.sharded())

    @property
    def local_grad(self) -> torch.Tensor:
        """This rank's shard of the reduced gradients (S elements), zeros when first made.

        Allocated on first use and kept until `release_grad()`; `reduce_scatter()` writes it
        (without zeroing first when it overwrites).
        """
        return self._grads.local

    @property
    def has_local_grad(self) -> bool:
        """Whether the gradient shard is allocated now (see `release_grad`)."""
        return self._grads.has_local

    def release_grad(self) -> None:
        """Drops the sharded gradient shard; the next use allocates a new one.

        For when nobody needs the gradients any more (the optimizer stepped and `.grad` was
        set to None): the memory is returned at once instead of being held through the next
        forward. Views handed out before keep their own memory alive, so none of them reads
        freed memory; `sharded_grad(name)` returns new views afterwards.

        Example:
            >>> buf.release_grad()
            >>> buf.local_grad.count_nonzero().item()  # a new, zeroed shard
            0
        """
        self._grads.release()

    # -- unshard / reshard --------------------------------------------------------------------

    def _global_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        memory = self._global.get(dtype)
        if memory is None:
            offsets = dict(self.layout.offsets)
            numel = self.layout.buffer_numel
            # On one rank the global buffer is the local shard: alias it (no copy, no memory),
            # unless the gather goes through a wire format (its values are the format's).
            alias = (
                self._comm.size == 1
                and dtype == self.dtype
                and self._wire is None
                and self.host_shard is None
            )
            backing = self.local if alias else None
            memory = FreeableBuffer(
                numel,
                offsets,
                self._shapes,
                dtype,
                self.device,
                "unsharded tensor",
                backing,
                check_freed=self.check_freed,
            )
            self._global[dtype] = memory
        self._unsharded = True
        return memory.allocate()

    def unshard(self, *, dtype: torch.dtype | None = None, async_op: bool = False) -> Handle:
        """All-gathers every rank's shard into the global buffer (of `dtype`, default ours).

        A no-op while that buffer is already unsharded (it returns the pending Handle, or a
        finished one), as FSDP2's `unshard()` is: after writing `local` (an optimizer step),
        `reshard()` first to gather the new values. Runs on the current stream; on CUDA,
        make that stream wait for whatever last wrote `local` if it is not the same stream.
        The gather writes through an alias with its own version counter, so tensors that
        autograd saved from `full(name)` before a `reshard()` stay valid for backward.

        Args:
            dtype: Gather in this dtype (mixed precision); the local shard is cast once.
            async_op: Return before the all-gather completes.

        Returns:
            A Handle; call `wait()` on the stream that reads `full(name)`.

        Example:
            >>> buf.unshard(dtype=torch.bfloat16).wait()
            >>> buf.full("w", dtype=torch.bfloat16).dtype
            torch.bfloat16
        """
        dtype = check_dtype("unshard dtype", dtype) or self.dtype
        memory = self._global.get(dtype)
        if memory is not None and memory.allocated:
            return self._pending_unshards.get(dtype) or Handle()
        if dtype in self._kept:
            return self._unshard_kept(dtype, async_op)
        buffer = self._global_buffer(dtype)
        if self._wire is not None:  # quantize, gather codes and scales, dequantize at wait
            works, then = self._wire.gather(self.local, buffer, self._comm, async_op=async_op)
            handle = Handle(works, device=self.device, event=record_event(self.device), then=then)
            self._pending_unshards[dtype] = handle
            if not async_op:
                handle.wait()
            return handle
        send = self.local
        if dtype != self.dtype or self.host_shard is not None:
            # Cast (or copy from host memory) straight into this rank's own chunk of the
            # global buffer, the only elementwise pass, and gather in place: no send buffer.
            send = self._comm.chunk(buffer)
            send.copy_(self.local, non_blocking=self.local.is_pinned())
        works = self._comm.all_gather(buffer, send, async_op=async_op)
        handle = Handle(works, device=self.device, event=record_event(self.device))
        self._pending_unshards[dtype] = handle
        return handle

    def reshard(self, *, keep_group: dist.ProcessGroup | None = None) -> None:
        """Frees the global buffers; the `full` views stay the same objects for the next unshard.

        An unshard still in flight is waited for first. Until the next `unshard()`, `full(name)`
        raises and reading a view obtained earlier raises a RuntimeError (the memory is freed).
        Runs on the current stream: on CUDA, call it on the stream that last read the views.

        Args:
            keep_group: Keep this rank's 1/k of each gathered buffer, k = the group's size,
                so that the next `unshard()` gathers over that group only (FSDP2's
                `reshard_after_forward=k`: a smaller, faster all-gather for backward, k/W of
                the gathered memory kept). Its ranks must be the k consecutive ranks of the
                shard axis this rank is among (k dividing the axis's size). None, or k equal
                to the axis's size: keep nothing (the next unshard gathers the shards).

        Example:
            >>> buf.unshard().wait()
            >>> buf.reshard()
            >>> buf.is_unsharded
            False
        """
        for handle in self._pending_unshards.values():
            handle.wait()
        self._pending_unshards = {}
        self._kept = {}
        keep = None if keep_group is None else self._comm.part(keep_group)
        if keep is not None and keep.size < self._comm.size:
            for dtype, memory in self._global.items():
                if memory.allocated:
                    whole = memory.allocate()  # the writer alias of what is gathered
                    self._kept[dtype] = (keep, keep.chunk(whole).clone())
        for memory in self._global.values():
            memory.free()
        self._unsharded = False

    def _unshard_kept(self, dtype: torch.dtype, async_op: bool) -> Handle:
        comm, piece = self._kept.pop(dtype)
        buffer = self._global_buffer(dtype)
        works = comm.all_gather(buffer, piece, async_op=async_op, label="DBuffer::all_gather_kept")
        handle = Handle(works, device=self.device, event=record_event(self.device))
        self._pending_unshards[dtype] = handle
        return handle

    @property
    def is_unsharded(self) -> bool:
        """Whether any global buffer holds memory (an unshard ran and no reshard since)."""
        return self._unsharded

    def full(self, name: str, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The unsharded tensor: a view of the global buffer, the same object every time.

        Raises:
            RuntimeError: the buffer is resharded (call `unshard()` first).
        """
        check_name(name, self._shapes)
        dtype = check_dtype("full dtype", dtype) or self.dtype
        memory = self._global.get(dtype)
        if memory is None or not memory.allocated:
            raise RuntimeError(
                f"DBuffer is resharded ({dtype}); call unshard() before full({name!r})"
            )
        return memory.views[name]

    # -- gradients ----------------------------------------------------------------------------

    def full_grad(self, name: str) -> torch.Tensor:
        """View of the global gradient buffer for `name`, to accumulate the full gradient into.

        The buffer is allocated on first use in a step and freed by `reduce_scatter()`; the
        view keeps its identity. Its range is zeroed on first use (`accumulate_grad` avoids
        that pass). A reduce-scatter still in flight is waited for first: it reads the buffer.

        Example:
            >>> _ = buf.full_grad("w").add_(grad_w)
        """
        return self._grads.full_view(name)

    def accumulate_grad(self, name: str, grad: torch.Tensor) -> None:
        """Adds `grad` (the full gradient of `name`) into the global gradient buffer.

        The first gradient of a step is copied in, later ones (gradient accumulation) are
        added; so the buffer is never zeroed as a whole.

        Example:
            >>> buf.accumulate_grad("w", grad_w)
            >>> torch.equal(buf.full_grad("w"), grad_w)
            True
        """
        self.accumulate_grads([name], [grad])

    def accumulate_grads(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """`accumulate_grad` for many tensors at once: one foreach copy and one foreach add.

        Args:
            names: Tensor names of this DBuffer.
            grads: Their full gradients, in the same order.

        Example:
            >>> buf.accumulate_grads(["w", "b"], [grad_w, grad_b])
            >>> torch.equal(buf.full_grad("b"), grad_b)
            True
        """
        self._grads.accumulate(names, grads)

    @property
    def reduce_pending(self) -> bool:
        """Whether a `reduce_scatter(async_op=True)` is in flight (not waited for yet)."""
        return self._grads.pending

    def wait_for_reduce(self) -> None:
        """Waits for a reduce-scatter in flight; a no-op when none is.

        Example:
            >>> buf.accumulate_grad("w", grad_w)
            >>> _ = buf.reduce_scatter(async_op=True)
            >>> buf.wait_for_reduce()
            >>> buf.reduce_pending
            False
        """
        self._grads.wait()

    def reduce_scatter(
        self,
        *,
        op: Literal["avg", "sum"] = "avg",
        divide_factor: float | None = None,
        reduce_dtype: torch.dtype | None = None,
        accumulate: bool = False,
        async_op: bool = False,
    ) -> Handle:
        """Reduces the global gradient buffer across ranks into `local_grad`, then frees it.

        Args:
            op: "avg" or "sum" over the shard axis.
            divide_factor: Divide the gradients by this before summing (replaces `op`); the
                division happens in place on the global gradient buffer.
            reduce_dtype: Reduce in this dtype (e.g. float32 for bf16 gradients).
            accumulate: Add the result to `local_grad` instead of overwriting it (sharded
                gradient accumulation: reduce every micro-batch, step once). It reduces into
                a temporary of S elements and adds it: one more pass than overwriting.
            async_op: Return before the collective completes.

        Returns:
            A Handle; `local_grad` and `sharded_grad(name)` hold the result after `wait()`,
            which also frees the global gradient buffer.

        Example:
            >>> buf.accumulate_grad("w", grad_w)
            >>> _ = buf.reduce_scatter(op="avg").wait()
            >>> buf.sharded_grad("w").full_tensor().equal(grad_w)  # one rank: the average
            True
        """
        return self._grads.reduce_scatter(
            op=op,
            divide_factor=divide_factor,
            reduce_dtype=reduce_dtype,
            accumulate=accumulate,
            async_op=async_op,
        )

    def all_reduce(
        self,
        *,
        op: Literal["avg", "sum"] = "avg",
        reduce_dtype: torch.dtype | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Reduces `local_grad` over the replicate axis (HSDP); a no-op without one.

        Args:
            op: "avg" or "sum" over the replicate axis.
            reduce_dtype: Reduce in this dtype (e.g. float32 for bf16 gradients): one cast
                of the S-element shard into a temporary and one back after the reduce.
            async_op: Return before the collective completes.

        Returns:
            A Handle; `local_grad` holds the result after `wait()`.

        Example:
            >>> buf.accumulate_grad("w", grad_w)
            >>> buf.reduce_scatter().wait(); buf.all_reduce().wait()  # no replicate axis: no-op
        """
        return self._grads.all_reduce(op=op, reduce_dtype=reduce_dtype, async_op=async_op)

    # -- moving the storage -------------------------------------------------------------------

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Converts the sharded storage with `fn` (a new device or dtype), keeping the layout.

        This is what `nn.Module._apply` does to a module's tensors (`.to(device)`,
        `to_empty(device=...)`, `.double()`): `local` becomes `fn(local)` and every sharded
        view is made again over it (new objects). Gradients start from zero. Used after
        building a model on the meta device: the buffer then allocates only this rank's shard.
        With a host shard, the shard stays in host memory and `fn`'s device computes.

        Args:
            fn: Maps the flat local shard to its converted copy (same number of elements).

        Raises:
            RuntimeError: the buffer is unsharded (call `reshard()` first).
            ValueError: `fn` did not return a tensor of S elements.

        Example:
            >>> buf.apply_(lambda t: t.double())
            >>> buf.sharded("w").dtype
            torch.float64
        """
        if self.is_unsharded:
            raise RuntimeError("apply_() needs a resharded DBuffer: call reshard() first")
        self._grads.wait()
        local: object = fn(self.local)
        if not isinstance(local, torch.Tensor) or local.numel() != self.shard_size:
            got = local.shape if isinstance(local, torch.Tensor) else type(local).__name__
            raise ValueError(
                f"apply_: fn must return a tensor of {self.shard_size} elements, got {got}"
            )
        local = local.contiguous().view(-1)
        self.dtype, self.device = local.dtype, local.device
        if self.host_shard is not None:  # the conversion's device computes; the shard stays
            self.device = compute_device(local.device, self.mesh)
            local = self.host_shard.place(local, self.device)
        self.local = local
        self._comm = comm_for(self.mesh.get_group(self.shard_axis), self.device)
        self._global = {}
        self._pending_unshards = {}
        self._views = ShardViews(
            self.layout, self._shapes, self._outer, self.mesh, self.shard_axis, self.local
        )
        self._grads = self._new_gradients()

    # -- group ops ----------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zeroes the local gradient (one kernel) and the global one (lazily, no kernel)."""
        self._grads.zero()

    def scale_grad_(self, factor: float) -> None:
        """Multiplies the local gradient shard by `factor` in one kernel."""
        self._grads.scale_(factor)

    def copy_(self, other: DBuffer | Mapping[str, torch.Tensor]) -> None:
        """Copies values from a DBuffer of the same layout (one kernel) or full tensors by name."""
        if isinstance(other, DBuffer):
            if other.layout != self.layout:
                raise ValueError("copy_ needs a DBuffer with the same layout")
            self.local.copy_(other.local)
            return
        if not isinstance(other, Mapping):
            raise TypeError(
                f"copy_ takes a DBuffer or a mapping of name to tensor, got {type(other).__name__}"
            )
        base = self._rank * self.shard_size
        for name, value in other.items():
            check_name(name, self._shapes)
            given: object = value  # callers may pass anything; check before use
            if not isinstance(given, torch.Tensor) or given.shape != self._shapes[name]:
                got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given)
                raise ValueError(
                    f"copy_ of {name!r}: expected a tensor of shape "
                    f"{tuple(self._shapes[name])}, got {got}"
                )
            lo, hi = held_range(self.layout, name, self._rank, self._shapes[name].numel())
            if hi > lo:
                start = base + lo - self.layout.offsets[name]
                self.local[lo:hi].copy_(value.reshape(-1)[start : start + hi - lo])
