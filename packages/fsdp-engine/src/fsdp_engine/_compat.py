"""Every touch of a torch internal in fsdp_engine lives here, behind ragged_placement's guard.

- `queue_backward_callback(fn)`: `Variable._execution_engine.queue_callback`, which runs `fn`
  once the current backward pass has finished (the engine's end-of-backward work: reduce the
  groups no hook reached, wait for the reduce-scatters, hand out the sharded gradients).
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ragged_placement import check_torch_version

__all__ = ["queue_backward_callback"]


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs `fn` when the backward pass now running finishes (call it from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


check_torch_version("fsdp_engine")
