"""CommCounter: records every collective issued inside it, including torch's own.

It is a TorchDispatchMode: c10d collectives (`dist.all_gather_into_tensor`, ...) and the
functional collectives DTensor uses (`_c10d_functional.*`) are dispatcher ops, so the mode
sees them whoever issues them. Each is recorded with its group size and this rank's logical
volume, the bytes it must send to / receive from other ranks at minimum (not what a given
backend algorithm puts on the wire):
- all_gather: sends its input to m-1 peers, receives the other m-1 pieces;
- reduce_scatter: sends and receives the input minus its own output's share;
- all_reduce: the tensor's bytes each way;
- all_to_all: the splits for other ranks / from other ranks (its own split stays local);
- broadcast: the source sends to m-1 peers, every other rank receives the tensor once;
- gather / scatter: every rank but the root sends / receives its tensor; the root receives /
  sends the m-1 others;
- send / recv: the tensor's bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ragged_placement._compat import DispatchMode, op_arguments, process_group_from_op_arg


@dataclass(frozen=True)
class Collective:
    """One collective seen by a CommCounter.

    Attributes:
        kind: "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
            "scatter", "gather", "send", "recv" or "barrier".
        op: The dispatcher op name, e.g. "c10d.alltoall_base_.default".
        group_size: Ranks in the collective's group.
        bytes_sent: Bytes this rank sends to other ranks.
        bytes_received: Bytes this rank receives from other ranks.
    """

    kind: str
    op: str
    group_size: int
    bytes_sent: int
    bytes_received: int


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


_KINDS = {
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "broadcast": "broadcast",
    "scatter": "scatter",
    "gather": "gather",
    "send": "send",
    "recv": "recv",
    "barrier": "barrier",
}


def _kind(name: str) -> str | None:
    namespace, _, rest = name.partition(".")
    if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
        return None
    base = rest.split(".")[0].strip("_")
    for key, kind in _KINDS.items():
        if base.startswith(key):
            return kind
    return None


def _group(named: dict[str, Any]) -> dist.ProcessGroup | None:
    return process_group_from_op_arg(named.get("process_group", named.get("group_name")))


def _ints(arg: Any) -> list[int]:
    return [int(x) for x in arg] if isinstance(arg, (list, tuple)) else []


class CommCounter(DispatchMode):
    """Records collectives issued inside the `with` block, on this rank.

    Example:
        >>> with CommCounter() as comms:
        ...     _ = distribute_tensor(weight, mesh, [Replicate()])  # broadcasts from rank 0
        >>> comms.counts(), comms.bytes_received  # rank 0 is the source: it receives nothing
        (Counter({'broadcast': 1}), 0)
    """

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    @property
    def bytes_sent(self) -> int:
        """Total bytes this rank sent."""
        return sum(c.bytes_sent for c in self.collectives)

    @property
    def bytes_received(self) -> int:
        """Total bytes this rank received."""
        return sum(c.bytes_received for c in self.collectives)

    def counts(self) -> Counter[str]:
        """Number of collectives per kind."""
        return Counter(c.kind for c in self.collectives)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = _kind(str(func))
        if kind is not None:
            self.collectives.append(_describe(kind, func, args, kwargs))
        return func(*args, **kwargs)


def _pick(named: dict[str, Any], *keys: str) -> Any:
    return next((named[k] for k in keys if k in named), None)


def _describe(kind: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Collective:
    named = dict(zip((a.name for a in op_arguments(func)), args, strict=False))
    named.update(kwargs)
    group = _group(named)
    m = group.size() if group is not None else 1
    me = group.rank() if group is not None else 0
    functional = str(func).startswith("_c10d_functional")
    out = _pick(named, "output", "output_tensor", "output_tensors", "outputs")
    inp = _pick(named, "input", "input_tensor", "input_tensors", "inputs", "tensors")
    sent, received = _volume(kind, functional, named, out, inp, m, me) if m > 1 else (0, 0)
    return Collective(kind, str(func), m, sent, received)


def _volume(
    kind: str, functional: bool, named: dict[str, Any], out: Any, inp: Any, m: int, me: int
) -> tuple[int, int]:
    n_in, n_out = _nbytes(inp), _nbytes(out)
    if kind == "all_gather":
        # Functional ops return the output; its size is m times the input.
        received = n_in * (m - 1) if functional else n_out - n_in
        return n_in * (m - 1), received
    if kind == "reduce_scatter":
        moved = n_in - n_in // m if functional else n_in - n_out
        return moved, moved
    if kind == "all_reduce":
        return n_in, n_in
    if kind == "all_to_all":
        size = inp.element_size()
        out_numel = out.numel() if isinstance(out, torch.Tensor) else inp.numel()
        out_splits = _ints(named.get("output_split_sizes")) or [out_numel // m] * m
        in_splits = _ints(named.get("input_split_sizes")) or [inp.numel() // m] * m
        return (sum(in_splits) - in_splits[me]) * size, (sum(out_splits) - out_splits[me]) * size
    if kind == "broadcast":
        root = int(_pick(named, "root_rank", "src") or 0)
        return (n_in * (m - 1), 0) if me == root else (0, n_in)
    if kind in ("gather", "scatter"):
        root = int(_pick(named, "root_rank", "dst", "src") or 0)
        if kind == "gather":  # the root receives every other rank's input
            return (0, n_out - n_in) if me == root else (n_in, 0)
        return (n_in - n_out, 0) if me == root else (0, n_out)
    if kind == "send":
        return n_in, 0
    if kind == "recv":
        return 0, n_in
    return n_in, n_out  # barrier
