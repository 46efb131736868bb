"""What every optimizer here shares with torch's: `step`'s closure, zero_grad, the state's order.

`StepOptimizer.step(closure)` runs the closure with gradients enabled, then the subclass's
`_step()` under no_grad, as torch's optimizers do; `zero_grad()` sets each `.grad` to None
without reading it first (torch's reads each one: a DTensor's `.grad` costs ~0.4 us, a third
of the optimizer's own host work on a model of many small parameters).

`state` is kept in the parameters' order. The subclasses fill it run by run, and runs follow
storage order, which differs between ranks (a rank whose piece of a tensor is empty has no
run for it); torch's full and sharded optimizer state dicts (`get_state_dict`) gather the
entries in the order of `state`, so ranks in different orders hang or mix tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ragged_optimizers._tracked_state import TrackedState


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


class StepOptimizer(Optimizer):
    """A torch Optimizer whose subclasses implement `_step()` (one step, no closure)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = closure_loss(closure)
        state = self.state
        if state.changed:
            self._state_changed()
        self._step()
        if len(state) != getattr(self, "_ordered_entries", -1):
            self._order_state()
        state.changed = False  # what `_step` wrote into the entries is its own
        return loss

    @property  # type: ignore[override]
    def state(self) -> TrackedState:
        """The state by parameter, as torch's `Optimizer.state`; edits are followed.

        Replacing, deleting or clearing entries (or all of `state`) is read back at the next
        step, as torch's optimizers read their state (see `_tracked_state.py`).
        """
        found = self.__dict__.get("state")
        if type(found) is not TrackedState:
            # Set by torch's `__init__`, `load_state_dict` (through `__setstate__`) or a user.
            found = self.__dict__["state"] = TrackedState(found.items() if found else ())
        return found

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["state"] = TrackedState(value.items())

    def _state_changed(self) -> None:
        """Called before a step when `state` was edited since the last (override to re-read)."""

    def _order_state(self) -> None:
        """Puts `state` in the order of the parameters in `param_groups` (in place).

        Run when the number of entries changed (their first step), so a step's host work
        stays O(1) here.
        """
        # Through dict's own methods: reordering is no edit (`state.changed` stays).
        state = self.state
        order = [p for group in self.param_groups for p in group["params"]]
        entries = {p: dict.pop(state, p) for p in order if p in state}
        rest = dict(state)  # entries for tensors in no param group, after the others
        dict.clear(state)
        dict.update(state, entries)
        dict.update(state, rest)
        self._ordered_entries = len(state)

    def state_dict(self) -> dict[str, Any]:
        """The state dict in torch's format, `state` in the parameters' order on every rank.

        Example:
            >>> from ragged_optimizers import AdamW
            >>> layer = torch.nn.Linear(2, 2)
            >>> opt = AdamW(layer.parameters())
            >>> layer(torch.ones(1, 2)).sum().backward(); opt.step()
            >>> list(opt.state_dict()["state"])
            [0, 1]
        """
        self._order_state()
        out = super().state_dict()
        out["state"] = {k: dict(v) for k, v in out["state"].items()}  # plain dicts, as torch's
        return out

    def _step(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _step(), the step itself")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients, as torch's `Optimizer.zero_grad`.

        Args:
            set_to_none: Set each `.grad` to None (else zero it in place, as torch does).
        """
        if not set_to_none:
            super().zero_grad(set_to_none=False)
            return
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None
