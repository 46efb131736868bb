"""DBuffer: a group of tensors living in one planned, evenly sharded buffer.

Memory model (see DESIGN.md, "DBuffer"):
- `local` is this rank's S elements (one allocation); each tensor's sharded piece is a view of
  it and is exposed as a RaggedShard DTensor (`sharded(name)`).
- `unshard()` all-gathers `local` straight into one global buffer of m * S elements; each
  tensor's unsharded form is a view of that buffer at its planned offset (`full(name)`). The
  views are made once and keep their identity: `reshard()` frees the storage under them
  (resize to 0) and the next `unshard()` re-allocates it, so no per-tensor allocation and no
  copy-in / copy-out ever happens. With `dtype=` (mixed precision) the local shard is cast
  once into a send buffer; that cast is the only elementwise pass.
- Gradients: `full_grad(name)` are views of one global grad buffer the caller accumulates
  into; `reduce_scatter()` reduces it straight into `local_grad`, whose views are the sharded
  gradients; `all_reduce()` then averages them over the replicate axis (HSDP).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement
from torch.profiler import record_function

from ragged_placement import RaggedShard
from shard_planner import Layout, TensorSpec, plan_layout

BlockRows = int | Mapping[str, int] | Callable[[str, torch.Size], int]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class Handle:
    """A pending collective of a DBuffer; `wait()` blocks until it is done (idempotent)."""

    def __init__(self, works: Sequence[dist.Work | None] = ()) -> None:
        self._works = [w for w in works if w is not None]

    def wait(self) -> None:
        """Waits for the collective."""
        if self._works:
            # Backends may finish a collective (e.g. copy out of a staging buffer) in wait().
            with record_function("DBuffer::wait"):
                for work in self._works:
                    work.wait()
        self._works = []


class DBuffer:
    """Tensors of one dtype and device, planned into one evenly sharded buffer.

    Args:
        tensors: (name, tensor) pairs, contiguous, one dtype and one device; their values are
            copied into the local shard once, at construction.
        mesh: The device mesh.
        shard_dim: Mesh axis the buffer is sharded over.
        replicate_dim: Mesh axis it is replicated over (HSDP), or None.
        block_rows: Rows per unshardable block: one int for all, a mapping by name (missing
            names get 1), or a function of (name, shape).
        align_bytes: Every rank's chunk starts at a multiple of this many bytes.
        layout: A precomputed layout for exactly these tensors (names, sizes, world size).

    Example:
        >>> buf = DBuffer([("w", w), ("b", b)], mesh, block_rows={"w": 32})  # doctest: +SKIP
        >>> buf.unshard().wait()  # doctest: +SKIP
        >>> buf.full("w") is buf.full("w")  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        mesh: DeviceMesh,
        *,
        shard_dim: int = 0,
        replicate_dim: int | None = None,
        block_rows: BlockRows = 1,
        align_bytes: int = 16,
        layout: Layout | None = None,
    ) -> None:
        tensors = list(tensors)
        _check_tensors(list(tensors))
        self.mesh = mesh
        self.shard_dim = _check_axis("shard_dim", shard_dim, mesh)
        self.replicate_dim = (
            None if replicate_dim is None else _check_axis("replicate_dim", replicate_dim, mesh)
        )
        if self.replicate_dim == self.shard_dim:
            raise ValueError(f"replicate_dim and shard_dim must differ, both are {shard_dim}")
        first = tensors[0][1]
        self.dtype, self.device = first.dtype, first.device
        _check_block_rows(block_rows, {name for name, _ in tensors})
        self._shapes = {name: t.shape for name, t in tensors}
        world = mesh.size(self.shard_dim)
        specs = [
            TensorSpec.from_shape(name, t.shape, _rows(block_rows, name, t.shape), num_shard_dims=1)
            for name, t in tensors
        ]
        align_value: object = align_bytes  # callers may pass anything; check before trusting
        if (
            isinstance(align_value, bool)
            or not isinstance(align_value, int)
            or align_bytes < 1
            or align_bytes % first.element_size()
        ):
            raise ValueError(
                f"align_bytes must be a positive multiple of the itemsize {first.element_size()}, "
                f"got {align_bytes}"
            )
        align = align_bytes // first.element_size()
        self.layout = layout if layout is not None else plan_layout(specs, world, align=align)
        _check_layout(self.layout, specs, world)
        self._rank = mesh.get_local_rank(self.shard_dim)
        self._group = mesh.get_group(self.shard_dim)
        size = self.layout.shard_size
        self.local = torch.zeros(size, dtype=self.dtype, device=self.device)
        base = self._rank * size
        for name, t in tensors:
            lo, hi = self.layout.local_range(name, self._rank)
            if hi > lo:
                start = base + lo - self.layout.offsets[name]
                self.local[lo:hi].copy_(t.reshape(-1)[start : start + hi - lo])
        self._sharded = {name: self._make_sharded(name, self.local) for name, _ in tensors}
        self._global: dict[torch.dtype, torch.Tensor] = {}
        self._full_views: dict[torch.dtype, dict[str, torch.Tensor]] = {}
        self._unsharded: set[torch.dtype] = set()
        self._grad: torch.Tensor | None = None
        self._grad_views: dict[str, torch.Tensor] = {}
        self.local_grad = torch.zeros_like(self.local)
        self._sharded_grads = {
            name: self._make_sharded(name, self.local_grad) for name, _ in tensors
        }

    # -- sizes and names ----------------------------------------------------------------------

    @property
    def shard_size(self) -> int:
        """Elements per rank, S."""
        return self.layout.shard_size

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in the caller's order."""
        return tuple(self._shapes)

    def _check_name(self, name: str) -> None:
        if name not in self._shapes:
            shown = ", ".join(list(self._shapes)[:8])
            raise KeyError(f"no tensor named {name!r} in this DBuffer; valid: {shown}")

    # -- sharded views ------------------------------------------------------------------------

    def _placements(self, name: str) -> list[Placement]:
        shape = self._shapes[name]
        unit = self.layout.unit(name)
        row = math.prod(shape[1:])
        # Cut whole rows when every unit is whole rows; otherwise allow cuts anywhere.
        dims = (0,) if len(shape) <= 1 or unit % row == 0 else tuple(range(len(shape)))
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        placements[self.shard_dim] = RaggedShard(dims, self.layout.local_units(name))
        return placements

    def _make_sharded(self, name: str, storage: torch.Tensor) -> DTensor:
        lo, hi = self.layout.local_range(name, self._rank)
        shape = self._shapes[name]
        if self.layout.spec(name).numel == 0:  # nothing to shard: an empty replicated view
            replicated = [Replicate()] * self.mesh.ndim
            return DTensor.from_local(storage[0:0].view(shape), self.mesh, replicated)
        return DTensor.from_local(storage[lo:hi], self.mesh, self._placements(name), shape=shape)

    def sharded(self, name: str) -> DTensor:
        """Tensor `name` as a RaggedShard DTensor whose local tensor is a view of `local`."""
        self._check_name(name)
        return self._sharded[name]

    def sharded_grad(self, name: str) -> DTensor:
        """The reduced gradient of `name`, a RaggedShard DTensor viewing `local_grad`."""
        self._check_name(name)
        return self._sharded_grads[name]

    # -- unshard / reshard --------------------------------------------------------------------

    def _global_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        nbytes = self.layout.buffer_numel * dtype.itemsize
        buffer = self._global.get(dtype)
        if buffer is None:
            buffer = torch.empty(self.layout.buffer_numel, dtype=dtype, device=self.device)
            self._global[dtype] = buffer
            self._full_views[dtype] = {
                name: buffer[off : off + self.layout.spec(name).numel].view(self._shapes[name])
                for name, off in self.layout.offsets.items()
            }
        elif buffer.untyped_storage().size() == 0:
            buffer.untyped_storage().resize_(nbytes)  # the views see the new memory
        return buffer

    def unshard(self, *, dtype: torch.dtype | None = None, async_op: bool = False) -> Handle:
        """All-gathers every rank's shard into the global buffer (of `dtype`, default ours).

        Returns:
            A Handle; `full(name)` may be read after `wait()`.
        """
        dtype = _check_dtype("unshard dtype", dtype) or self.dtype
        buffer = self._global_buffer(dtype)
        self._unsharded.add(dtype)
        if dtype == self.dtype:
            send = self.local
        else:
            # Cast straight into this rank's own chunk of the global buffer (the only
            # elementwise pass) and all-gather in place: no send buffer is allocated.
            start = self._rank * self.shard_size
            send = buffer[start : start + self.shard_size]
            send.copy_(self.local)
        if self._group.size() == 1:  # the buffer is this rank's chunk
            if dtype == self.dtype:
                buffer.copy_(self.local)
            return Handle()
        with record_function("DBuffer::all_gather"):
            work = dist.all_gather_single(buffer, send, group=self._group, async_op=async_op)
        return Handle([work] if async_op else [])

    def reshard(self) -> None:
        """Frees the global buffers; the `full` views stay the same objects for the next unshard.

        Until then `full(name)` raises, but a view obtained earlier must not be read: its
        storage is freed (as with FSDP2's unsharded parameters, reading it is undefined).
        """
        for buffer in self._global.values():
            buffer.untyped_storage().resize_(0)
        self._unsharded.clear()

    def full(self, name: str, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The unsharded tensor: a view of the global buffer, the same object every time.

        Raises:
            RuntimeError: the buffer is resharded (call `unshard()` first).
        """
        self._check_name(name)
        dtype = _check_dtype("full dtype", dtype) or self.dtype
        if dtype not in self._unsharded:
            raise RuntimeError(
                f"DBuffer is resharded ({dtype}); call unshard() before full({name!r})"
            )
        return self._full_views[dtype][name]

    # -- gradients ----------------------------------------------------------------------------

    def full_grad(self, name: str) -> torch.Tensor:
        """View of the global gradient buffer for `name`; accumulate the full gradient here."""
        self._check_name(name)
        if self._grad is None:
            self._grad = torch.zeros(self.layout.buffer_numel, dtype=self.dtype, device=self.device)
            self._grad_views = {
                n: self._grad[off : off + self.layout.spec(n).numel].view(self._shapes[n])
                for n, off in self.layout.offsets.items()
            }
        return self._grad_views[name]

    def reduce_scatter(
        self,
        *,
        op: Literal["avg", "sum"] = "avg",
        divide_factor: float | None = None,
        reduce_dtype: torch.dtype | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Reduces the global gradient buffer across ranks into `local_grad`.

        Args:
            op: "avg" or "sum" over the shard axis.
            divide_factor: Divide the gradients by this before summing (replaces `op`); the
                division happens in place on the global gradient buffer.
            reduce_dtype: Reduce in this dtype (e.g. float32 for bf16 gradients).
            async_op: Return before the collective completes.
        """
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        _check_dtype("reduce_dtype", reduce_dtype)
        if self._grad is None:
            raise RuntimeError("no gradient to reduce: write into full_grad(name) first")
        grad = self._grad
        if divide_factor is not None:
            if divide_factor <= 0:
                raise ValueError(f"divide_factor must be > 0, got {divide_factor}")
            grad.div_(divide_factor)
            op = "sum"
        send = grad if reduce_dtype in (None, self.dtype) else grad.to(reduce_dtype)
        out = (
            self.local_grad
            if send.dtype == self.dtype
            else torch.empty(self.shard_size, dtype=send.dtype, device=self.device)
        )
        if self._group.size() == 1:
            out.copy_(send)
            works: list[dist.Work | None] = []
        else:
            with record_function("DBuffer::reduce_scatter"):
                works = [
                    dist.reduce_scatter_single(
                        out, send, op=_OPS[op], group=self._group, async_op=async_op
                    )
                ]
        if out is not self.local_grad:
            for w in works:
                if w is not None:
                    w.wait()
            self.local_grad.copy_(out)
            works = []
        return Handle(works if async_op else [])

    def all_reduce(self, *, op: Literal["avg", "sum"] = "avg", async_op: bool = False) -> Handle:
        """Reduces `local_grad` over the replicate axis (HSDP); a no-op without one."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        if self.replicate_dim is None or self.mesh.size(self.replicate_dim) == 1:
            return Handle()
        group = self.mesh.get_group(self.replicate_dim)
        with record_function("DBuffer::all_reduce"):
            work = dist.all_reduce(self.local_grad, op=_OPS[op], group=group, async_op=async_op)
        return Handle([work] if async_op else [])

    # -- group ops ----------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zeroes the local and (if allocated) global gradient buffers, one kernel each."""
        self.local_grad.zero_()
        if self._grad is not None:
            self._grad.zero_()

    def scale_grad_(self, factor: float) -> None:
        """Multiplies the local gradient shard by `factor` in one kernel."""
        self.local_grad.mul_(factor)

    def copy_(self, other: DBuffer | Mapping[str, torch.Tensor]) -> None:
        """Copies values from a DBuffer of the same layout (one kernel) or full tensors by name."""
        if isinstance(other, DBuffer):
            if other.layout != self.layout:
                raise ValueError("copy_ needs a DBuffer with the same layout")
            self.local.copy_(other.local)
            return
        base = self._rank * self.shard_size
        for name, value in other.items():
            self._check_name(name)
            if value.shape != self._shapes[name]:
                raise ValueError(
                    f"copy_ of {name!r}: shape {tuple(value.shape)} != {tuple(self._shapes[name])}"
                )
            lo, hi = self.layout.local_range(name, self._rank)
            start = base + lo - self.layout.offsets[name]
            self.local[lo:hi].copy_(value.reshape(-1)[start : start + hi - lo])


def _rows(block_rows: BlockRows, name: str, shape: torch.Size) -> int:
    if isinstance(block_rows, int):
        return block_rows
    if isinstance(block_rows, Mapping):
        return block_rows.get(name, 1)
    if callable(block_rows):
        return block_rows(name, shape)
    raise TypeError(
        f"block_rows must be an int, a mapping of name to int, or a function of (name, shape); "
        f"got {type(block_rows).__name__}"
    )


def _check_block_rows(block_rows: BlockRows, names: set[str]) -> None:
    if isinstance(block_rows, Mapping):
        unknown = sorted(set(block_rows) - names)
        if unknown:
            raise ValueError(f"block_rows names tensors that are not in the DBuffer: {unknown}")


def _check_dtype(what: str, dtype: object) -> torch.dtype | None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype or None, got {dtype!r}")
    return dtype


def _check_axis(what: str, axis: object, mesh: DeviceMesh) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < mesh.ndim:
        raise ValueError(f"{what} must be a mesh axis in [0, {mesh.ndim}), got {axis!r}")
    return axis


def _check_tensors(tensors: list[tuple[str, object]]) -> None:
    if not tensors:
        raise ValueError("DBuffer needs at least one (name, tensor) pair")
    seen: set[str] = set()
    first: torch.Tensor | None = None
    for name, t in tensors:
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(
                f"DBuffer tensor {name!r} must be a plain torch.Tensor, got {type(t).__name__}"
            )
        if name in seen:
            raise ValueError(f"DBuffer tensor names must be unique, {name!r} repeats")
        seen.add(name)
        first = first if first is not None else t
        if not t.is_contiguous():
            raise ValueError(
                f"DBuffer tensor {name!r} must be contiguous (shape {tuple(t.shape)}, "
                f"stride {t.stride()})"
            )
        if t.dtype != first.dtype:
            raise ValueError(
                f"DBuffer tensors must share one dtype: {name!r} is {t.dtype}, "
                f"{tensors[0][0]!r} is {first.dtype}; make one DBuffer per dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"DBuffer tensors must share one device: {name!r} is on {t.device}, "
                f"{tensors[0][0]!r} on {first.device}"
            )


def _check_layout(layout: Layout, specs: list[TensorSpec], world: int) -> None:
    if layout.world_size != world:
        raise ValueError(
            f"layout is for world size {layout.world_size}, the shard axis has {world}"
        )
    planned = {s.name: s.numel for s in layout.tensors}
    given = {s.name: s.numel for s in specs}
    if planned != given:
        missing = sorted(set(given) - set(planned))
        extra = sorted(set(planned) - set(given))
        wrong = sorted(n for n in set(given) & set(planned) if given[n] != planned[n])
        raise ValueError(
            f"layout does not match the tensors: missing {missing}, unexpected {extra}, "
            f"different sizes {wrong}"
        )
    layout.validate()
