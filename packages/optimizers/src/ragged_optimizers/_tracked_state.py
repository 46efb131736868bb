"""An optimizer's `state` that notices when a user changes it.

The flat optimizers (`AdamW`, `AdamW8bit`) step one flat state tensor per run of adjacent
parameter pieces, and each parameter's `state` entries are views of it. A user who replaces
an entry (`state[p]["exp_avg"] = v.clone()`, the usual loop that moves state), clears
`state[p]`, deletes a parameter's state or clears the whole `state` would otherwise leave the
optimizer stepping its own flat copy while `state_dict()` returned the user's stale entries.

`TrackedState` is a `defaultdict(dict)` whose per-parameter dicts are `TrackedEntry`s; any
change through either sets `changed`, so the optimizer re-reads its state from the entries
(which become views of the flat state again) at its next step: the user's entries are the
truth, as in torch's AdamW. Checking costs one attribute read per step, not one per
parameter. In-place writes into an entry's tensor need no tracking: the entry is a view of
the flat state, so the write lands there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch


class TrackedEntry(dict[str, Any]):
    """One parameter's state: a dict that tells its `TrackedState` when it changes."""

    __slots__ = ("owner",)

    def __init__(self, items: Iterable[tuple[str, Any]] = (), owner: TrackedState | None = None):
        super().__init__(items)
        self.owner = owner

    def _touch(self) -> None:
        owner = getattr(self, "owner", None)  # unset while unpickling
        if owner is not None:
            owner.changed = True

    def __setitem__(self, key: str, value: Any) -> None:
        self._touch()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._touch()
        super().__delitem__(key)

    def clear(self) -> None:
        self._touch()
        super().clear()

    def pop(self, *args: Any) -> Any:
        self._touch()
        return super().pop(*args)

    def popitem(self) -> tuple[str, Any]:
        self._touch()
        return super().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:  # only adding is an edit
            self._touch()
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._touch()
        super().update(*args, **kwargs)

    def __ior__(self, other: Any) -> TrackedEntry:  # type: ignore[override,misc]
        self._touch()
        super().update(other)
        return self

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # pickles and deep-copies as a plain dict


class TrackedState(defaultdict[torch.Tensor, Any]):
    """An optimizer's `state`: by parameter, a `TrackedEntry`; `changed` after any edit.

    Example:
        >>> state = TrackedState()
        >>> p = torch.zeros(2)
        >>> state.changed = False
        >>> _ = state[p]  # reading makes p's empty entry: no edit
        >>> state.changed
        False
        >>> state[p]["exp_avg"] = torch.ones(2)
        >>> state.changed
        True
        >>> state.changed = False
        >>> state[p]["exp_avg"].mul_(2)[0].item(), state.changed  # in place: nothing to track
        (2.0, False)
    """

    def __init__(self, items: Iterable[tuple[torch.Tensor, Any]] = ()):
        super().__init__(self._new_entry)
        self.changed = True
        for param, entry in items:
            self[param] = entry

    def _new_entry(self) -> TrackedEntry:
        return TrackedEntry(owner=self)

    def __missing__(self, param: torch.Tensor) -> TrackedEntry:
        # Reading a parameter without state makes its empty entry: no edit (empty is none).
        entry = self._new_entry()
        dict.__setitem__(self, param, entry)
        return entry

    def _own(self, entry: Any) -> Any:
        if isinstance(entry, TrackedEntry) and entry.owner is self:
            return entry
        if isinstance(entry, dict):
            return TrackedEntry(entry.items(), owner=self)
        return entry

    def __setitem__(self, param: torch.Tensor, entry: Any) -> None:
        self.changed = True
        super().__setitem__(param, self._own(entry))

    def __delitem__(self, param: torch.Tensor) -> None:
        self.changed = True
        super().__delitem__(param)

    def clear(self) -> None:
        self.changed = True
        super().clear()

    def pop(self, *args: Any) -> Any:
        self.changed = True
        return super().pop(*args)

    def popitem(self) -> tuple[torch.Tensor, Any]:
        self.changed = True
        return super().popitem()

    def setdefault(self, param: torch.Tensor, default: Any = None) -> Any:
        if param not in self:
            self[param] = {} if default is None else default
        return self[param]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for param, entry in dict(*args, **kwargs).items():
            self[param] = entry

    def __ior__(self, other: Any) -> TrackedState:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce__(self) -> Any:
        # A plain defaultdict(dict) when pickled or deep-copied (torch's optimizers' type).
        return defaultdict, (dict,), None, None, iter((k, dict(v)) for k, v in self.items())
