"""GroupConfig: one `fully_shard` call's settings, frozen, replaced whole by each setter.

RootSettings: the few settings that act on a whole root's tree (FSDP2 keeps them on the
root), frozen too, on the root's shared `Context`, changed through `SettingsChange`s.

Every knob of a group lives here and nowhere else: `fully_shard` builds the first one, the
root's lazy init resolves `reshard_after_forward=None` (True except for the root), and each
`FSDPModule.set_*` method writes a new one through `configure`, which honours `recurse`. The
schedule (`_state.py`) and the group (`_group.py`) only read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GroupConfig:
    """A group's schedule and reduction settings (FSDP2's setters, one field each).

    Example:
        >>> import dataclasses
        >>> config = GroupConfig(reshard_after_forward=None)
        >>> dataclasses.replace(config, max_reduces_in_flight=2).max_reduces_in_flight
        2
    """

    # Free the gathered parameters after forward; None until the root is known. An int k:
    # keep 1/k of them, backward gathers over k ranks (the group made those groups).
    reshard_after_forward: bool | int | None
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    # Explicit prefetch targets (FSDPStates); None: the order recorded in the last iteration.
    forward_prefetch: tuple[Any, ...] | None = None
    backward_prefetch: tuple[Any, ...] | None = None
    max_reduces_in_flight: int = 1  # reduce-scatters in flight when this group's backward ends
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # HSDP: all-reduce over the replicate axis
    divide_factor: float | None = None
    force_sum_reduction: bool = False
    reduce_scatter_unused_params: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None


@dataclass(frozen=True)
class RootSettings:
    """What the setters that act on a whole root's tree set (FSDP2 keeps these on the root).

    Attributes:
        is_last_backward: The next backward waits for its reduces and sets the `.grad`s.
        post_optim_event: An event the root's next forward waits for (then cleared).
        manual_finalization: Backward passes keep the iteration open until `finalize`.
    """

    is_last_backward: bool = True
    post_optim_event: Any = None
    manual_finalization: bool = False


SettingsChange = Callable[[RootSettings], RootSettings]
