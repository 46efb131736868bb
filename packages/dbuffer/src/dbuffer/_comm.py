"""How a DBuffer's bytes move over one process group: chosen once, when the buffer is built.

Three kinds, as FSDP2 picks one all-gather object per group instead of branching per call:
- `NativeComm`: the backend's single-tensor all-gather and reduce-scatter (NCCL, or gloo on
  a device), which write straight into the output.
- `GlooInPlaceComm`: gloo on CPU. Its reduce-scatter all-reduces a clone of its input and
  its all-gather stages the whole output in a temporary; each temporary (as large as the
  buffer) would stay live until the wait. Reducing the buffer in place (an all-reduce whose
  result is read from this rank's chunk) and gathering with one broadcast per rank into that
  rank's chunk moves the same bytes without them.
- `OneRankComm`: a group of one; nothing is sent and the result is the input.

Every kind takes the same arguments; what differs is where the result lands, which the caller
reads from the facts `reduces_in_place` (the reduced chunk is a view of the input) and
`aliases_input` (the gathered output may be the input itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dbuffer._compat import all_gather_single, profiler_range, reduce_scatter_single

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}

Works = list[dist.Work | None]
Op = dist.ReduceOp.RedOpType


class ShardComm:
    """Gathers and reduce-scatters flat buffers over one group (see the module docstring).

    Args:
        group: The process group.
        device: The device of the buffers it moves.

    Attributes:
        size: The group's size, W.
        rank: This rank's index in the group.
        reduces_in_place: `reduce_scatter` leaves this rank's result in its chunk of the
            input (no output is written).
        gathers_in_place: `all_gather` first copies the input into this rank's chunk of the
            output (unless it is that chunk) and gathers from there.
    """

    reduces_in_place = False
    gathers_in_place = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.size, self.rank = group.size(), group.rank()
        self._parts: dict[dist.ProcessGroup, ShardComm] = {}

    def part(self, group: dist.ProcessGroup) -> ShardComm:
        """The comm over `group`: k consecutive ranks of this group, this rank among them.

        Checked once per group (a buffer is given it after every forward).

        Raises:
            ValueError: `group` is not such a part (naming both groups' ranks).
        """
        comm = self._parts.get(group)
        if comm is None:
            ranks, mine = (
                dist.get_process_group_ranks(group),
                dist.get_process_group_ranks(self.group),
            )
            parts = len(ranks)
            start = self.rank // parts * parts if self.size % parts == 0 else -1
            if (mine[start : start + parts] if start >= 0 else None) != ranks:
                raise ValueError(
                    f"keep_group has ranks {ranks}; it must be k consecutive ranks of this "
                    f"buffer's shard axis {mine} (k dividing {self.size}) that include this rank"
                )
            comm = self._parts[group] = comm_for(group, self.device)
        return comm

    def chunk(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's 1/W of `buffer` (a view)."""
        size = buffer.numel() // self.size
        return buffer.narrow(0, self.rank * size, size)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool,
        label: str = "DBuffer::all_gather",
    ) -> Works:
        """Gathers every rank's `input` into `output` (W times its size), in rank order.

        `input` may be this rank's chunk of `output` (gathering in place). `label` names the
        profiler range around the collective.
        """
        if self.size == 1 or self.gathers_in_place:  # staged outside the collective's range
            mine = self.chunk(output)
            if input.data_ptr() != mine.data_ptr():
                mine.copy_(input)
            if self.size == 1:
                return []
        with profiler_range(label):
            return self._all_gather(output, input, async_op)

    def reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, *, op: str, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        """Reduces `input` over the group; returns the works and where this rank's chunk is.

        `output` receives it, unless `reduces_in_place` (then it may be None, and the result
        is this rank's chunk of `input`).
        """
        if self.size == 1:
            return [], input
        if output is None and not self.reduces_in_place:
            raise ValueError(f"{type(self).__name__}.reduce_scatter needs an output tensor")
        with profiler_range("DBuffer::reduce_scatter"):
            return self._reduce_scatter(output, input, OPS[op], async_op)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Works:
        raise NotImplementedError(f"{type(self).__name__}._all_gather")

    def _reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, op: Op, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__}._reduce_scatter")


class NativeComm(ShardComm):
    """The backend's single-tensor collectives."""

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Works:
        return [all_gather_single(output, input, group=self.group, async_op=async_op)]

    def _reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, op: Op, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        assert output is not None  # checked by reduce_scatter
        work = reduce_scatter_single(output, input, op=op, group=self.group, async_op=async_op)
        return [work], output


class GlooInPlaceComm(ShardComm):
    """Gloo on CPU, without its staging temporaries (one broadcast per rank)."""

    reduces_in_place = True
    gathers_in_place = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        # Each rank's global rank: the source of the broadcast of its chunk.
        self._sources = dist.get_process_group_ranks(group)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Works:
        size = output.numel() // self.size
        return [
            dist.broadcast(output.narrow(0, i * size, size), source, self.group, async_op)
            for i, source in enumerate(self._sources)
        ]

    def _reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, op: Op, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        work = dist.all_reduce(input, op=op, group=self.group, async_op=async_op)
        return [work], self.chunk(input)


class OneRankComm(ShardComm):
    """A group of one rank: nothing crosses a wire (`ShardComm`'s own methods say so)."""

    reduces_in_place = True


def _cpu_backend_is_gloo(group: dist.ProcessGroup) -> bool:
    """Whether CPU tensors on `group` go through gloo (alone, or beside a device backend)."""
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def comm_for(group: dist.ProcessGroup, device: torch.device) -> ShardComm:
    """The comm object for buffers on `device` over `group`.

    Example:
        >>> type(comm_for(mesh.get_group(0), torch.device("cpu"))).__name__  # one rank
        'OneRankComm'
    """
    if group.size() == 1:
        return OneRankComm(group, device)
    if device.type == "cpu" and _cpu_backend_is_gloo(group):
        return GlooInPlaceComm(group, device)
    return NativeComm(group, device)
