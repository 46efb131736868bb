"""Every touch of a torch internal in fsdp_engine lives here, behind ragged_placement's guard.

- `queue_backward_callback(fn)`: `Variable._execution_engine.queue_callback`, which runs `fn`
  once the current backward pass has finished (the engine's end-of-backward work: reduce the
  groups no hook reached, wait for the reduce-scatters, hand out the sharded gradients).
- `profiler_range(name)`: `torch.profiler.record_function(name)` only while a profiler runs
  (`torch._C._autograd._profiler_enabled`): a range costs ~8 us even with no profiler, and
  a step enters a few per group.
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

from ragged_placement import check_torch_version

__all__ = ["profiler_range", "queue_backward_callback"]


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs `fn` when the backward pass now running finishes (call it from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_NO_RANGE = nullcontext()


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A profiler range named `name` while a profiler runs, else a no-op context."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


check_torch_version("fsdp_engine")
