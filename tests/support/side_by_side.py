"""Sharded models trained on this rank's rows beside one process trained on the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

Trained = tuple[nn.Module, torch.optim.Optimizer]


def steps_side_by_side(
    sharded: Sequence[Trained],
    reference: Trained,
    batches: Sequence[torch.Tensor],
    rank: int,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """One optimizer step per batch for each: the sharded on row `rank`, the reference on all.

    With one row per rank and a mean loss, the data-parallel average of the ranks' gradients
    is the reference's gradient of the whole batch.
    """
    for batch in batches:
        steps = [(model, opt, batch[rank : rank + 1]) for model, opt in sharded]
        for model, opt, rows in [*steps, (*reference, batch)]:
            loss(model(rows), rows).backward()
            opt.step()
            opt.zero_grad()
