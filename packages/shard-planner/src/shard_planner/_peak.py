"""The peak of one rank's memory in a training step, found by walking the step's phases.

A step's transients do not peak together: the activations are all alive when backward
begins, while the sharded gradients land one group at a time as backward goes on, and a
group's reduce-scatter input replaces the activations its backward frees. Adding up each
transient's maximum overstates the peak by 20% on a small decoder; `step_peak` instead
walks the backward as FSDP runs it (the groups in reverse of their forward order), and then
the optimizer update, and returns the largest live set beside the sharded parameters and
optimizer state (which are there throughout). In the backward of group g:

- the sharded gradients of the groups after g (each lands at its reduce-scatter;
  `zero_grad()` frees them after every step; under gradient accumulation, every group's
  from the first micro-batch on);
- the activations the groups before g keep, and g's own: what it keeps plus what is alive
  only in its backward (the loss's gradients, a checkpointed block's recomputation), or its
  unsharded gradients where those are larger (they take the place of what its backward frees);
- the gathered groups: g and the `prefetch` groups before it (when groups stay gathered
  from forward, `reshard_after_forward=False`: g and every group before it);
- the reduce-scatter input of the group after g, still in flight.

The update holds every group's sharded gradient, and whatever temporaries the optimizer makes
(`update_bytes`; `estimate` counts none, as a fused AdamW makes none: torch's foreach AdamW
holds one parameter-sized temporary, its denominators).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupBytes:
    """What one FSDP group adds to a rank's memory during a step (bytes).

    Attributes:
        name: The group's name.
        gathered: Its parameters gathered (W_g S_g, in the compute dtype).
        unsharded_grads: Its gradients as backward makes them, before the reduce-scatter.
        reduce_input: Its reduce-scatter input (and its cast to the reduce dtype, if any).
        sharded_grad: Its sharded gradient (S_g, in the parameters' dtype).
        kept: Activations its forward keeps for its backward (one micro-batch).
        extra: Activations alive only during its backward.
    """

    name: str
    gathered: int
    unsharded_grads: int
    reduce_input: int
    sharded_grad: int
    kept: int = 0
    extra: int = 0


@dataclass(frozen=True)
class Peak:
    """The largest live set of a step beside the sharded parameters and optimizer state.

    Attributes:
        phase: When: "backward of <group>" or "optimizer update".
        grad_bytes: Sharded gradients alive then.
        activation_bytes: Activations alive then.
        gathered_bytes: Gathered parameters.
        reduce_input_bytes: Unsharded gradients and reduce-scatter inputs.
        update_bytes: The optimizer update's temporaries.
    """

    phase: str
    grad_bytes: int
    activation_bytes: int = 0
    gathered_bytes: int = 0
    reduce_input_bytes: int = 0
    update_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Everything the peak holds beyond the sharded parameters and optimizer state."""
        return (
            self.grad_bytes
            + self.activation_bytes
            + self.gathered_bytes
            + self.reduce_input_bytes
            + self.update_bytes
        )


def step_peak(
    groups: Sequence[GroupBytes],
    *,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    accumulating: bool = False,
    update_bytes: int = 0,
) -> Peak:
    """The step's peak beside the sharded state (module docstring), in O(groups).

    Args:
        groups: Each group's bytes, in forward order.
        prefetch: Groups gathered ahead of the one computing.
        reshard_after_forward: False keeps every group gathered from forward to its backward.
        accumulating: Gradient accumulation: every sharded gradient is alive throughout the
            last micro-batch's backward.
        update_bytes: The optimizer update's temporaries.

    Returns:
        The Peak: the backward's largest live set, or the update's where that is larger.

    Example:
        >>> blocks = [GroupBytes(f"layers.{i}", gathered=100, unsharded_grads=100,
        ...                      reduce_input=100, sharded_grad=25, kept=300) for i in range(3)]
        >>> step_peak(blocks, update_bytes=75)
        Peak(phase='backward of layers.2', grad_bytes=0, activation_bytes=900, gathered_bytes=200, reduce_input_bytes=0, update_bytes=0)
    """  # noqa: E501
    all_grads = sum(g.sharded_grad for g in groups)
    best = Peak("optimizer update", all_grads, update_bytes=update_bytes)
    kept_before = list(itertools.accumulate((g.kept for g in groups), initial=0))
    gathered_before = list(itertools.accumulate((g.gathered for g in groups), initial=0))
    done = 0  # sharded gradients of the groups whose backward has run
    for index in range(len(groups) - 1, -1, -1):
        group = groups[index]
        first = max(0, index - prefetch) if reshard_after_forward else 0
        in_flight = groups[index + 1].reduce_input if index + 1 < len(groups) else 0
        own = group.kept + group.extra
        peak = Peak(
            f"backward of {group.name}",
            all_grads if accumulating else done,
            kept_before[index] + max(own, 0),
            gathered_before[index + 1] - gathered_before[first],
            in_flight + max(group.unsharded_grads - own, 0),
        )
        if peak.total_bytes > best.total_bytes:
            best = peak
        done += group.sharded_grad
    return best
