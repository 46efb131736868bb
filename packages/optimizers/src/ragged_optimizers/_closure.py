"""The closure protocol of `torch.optim.Optimizer.step`, shared by both optimizers."""

from __future__ import annotations

from collections.abc import Callable

import torch


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """Runs `closure` with gradients enabled (inside a no-grad step); its loss, or None.

    Example:
        >>> closure_loss(lambda: 1.5), closure_loss(None)
        (1.5, None)
    """
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
