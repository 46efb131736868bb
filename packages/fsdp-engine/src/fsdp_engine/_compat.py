"""Every touch of a torch internal in fsdp_engine lives here, behind a version guard.

- `queue_backward_callback(fn)`: `Variable._execution_engine.queue_callback`, which runs `fn`
  once the current backward pass has finished (the engine's end-of-backward work: reduce the
  groups no hook reached, wait for the reduce-scatters, hand out the sharded gradients).
Tested on torch 2.13 and 2.14 (`nox -s tests`); other versions are refused at import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SUPPORTED_TORCH", "queue_backward_callback"]

SUPPORTED_TORCH = ((2, 13), (2, 14))


def _check_torch_version() -> None:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) not in SUPPORTED_TORCH:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
        raise ImportError(
            f"fsdp_engine supports torch {supported}; found torch {torch.__version__}"
        )


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs `fn` when the backward pass now running finishes (call it from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_check_torch_version()
