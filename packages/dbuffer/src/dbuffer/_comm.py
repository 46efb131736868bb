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
    """

    reduces_in_place = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.size, self.rank = group.size(), group.rank()

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
        raise NotImplementedError(f"{type(self).__name__}.all_gather")

    def reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, *, op: str, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        """Reduces `input` over the group; returns the works and where this rank's chunk is.

        `output` receives it, unless `reduces_in_place` (then it may be None, and the result
        is this rank's chunk of `input`).
        """
        raise NotImplementedError(f"{type(self).__name__}.reduce_scatter")


class NativeComm(ShardComm):
    """The backend's single-tensor collectives."""

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool,
        label: str = "DBuffer::all_gather",
    ) -> Works:
        with profiler_range(label):
            return [all_gather_single(output, input, group=self.group, async_op=async_op)]

    def reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, *, op: str, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        if output is None:
            raise ValueError("NativeComm.reduce_scatter needs an output tensor")
        with profiler_range("DBuffer::reduce_scatter"):
            work = reduce_scatter_single(
                output, input, op=OPS[op], group=self.group, async_op=async_op
            )
        return [work], output


class GlooInPlaceComm(ShardComm):
    """Gloo on CPU, without its staging temporaries (one broadcast per rank)."""

    reduces_in_place = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        # Each rank's global rank: the source of the broadcast of its chunk.
        self._sources = dist.get_process_group_ranks(group)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool,
        label: str = "DBuffer::all_gather",
    ) -> Works:
        mine = self.chunk(output)
        if input.data_ptr() != mine.data_ptr():
            mine.copy_(input)
        size = mine.numel()
        with profiler_range(label):
            return [
                dist.broadcast(
                    output.narrow(0, index * size, size), source, self.group, async_op=async_op
                )
                for index, source in enumerate(self._sources)
            ]

    def reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, *, op: str, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        with profiler_range("DBuffer::reduce_scatter"):
            work = dist.all_reduce(input, op=OPS[op], group=self.group, async_op=async_op)
        return [work], self.chunk(input)


class OneRankComm(ShardComm):
    """A group of one rank: nothing crosses a wire."""

    reduces_in_place = True

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool,
        label: str = "DBuffer::all_gather",
    ) -> Works:
        if input.data_ptr() != output.data_ptr():
            output.copy_(input)
        return []

    def reduce_scatter(
        self, output: torch.Tensor | None, input: torch.Tensor, *, op: str, async_op: bool
    ) -> tuple[Works, torch.Tensor]:
        return [], input


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
