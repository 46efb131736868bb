"""The global (unsharded) gradient buffer of a DBuffer, initialized lazily.

The buffer holds every tensor's full gradient at its planned offset, so the reduce-scatter
reads it in place. It lives only between the first gradient of a step and that step's
reduce-scatter, which frees it; its views keep their identity across steps.

A fresh buffer is not zeroed as a whole: the first gradient of a tensor is copied in
(`accumulate`), later ones are added, and only what nobody wrote (tensors without a gradient
and the planner's padding) is zeroed just before the reduce-scatter. A caller that wants a
view to accumulate into by hand (`view`) gets that tensor's range zeroed first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dbuffer._compat import foreach_add_, foreach_copy_
from dbuffer._freeable import FreeableBuffer
from shard_planner import Layout


class FullGradBuffer:
    """Lazy initialization of one DBuffer's global gradient buffer (a FreeableBuffer).

    Args:
        layout: The DBuffer's layout.
        shapes: Each tensor's shape.
        dtype: The gradients' dtype.
        device: Their device.
        check_freed: Guard the views against reads while freed (see `FreeableBuffer`).
    """

    def __init__(
        self,
        layout: Layout,
        shapes: dict[str, torch.Size],
        dtype: torch.dtype,
        device: torch.device,
        *,
        check_freed: bool = False,
    ) -> None:
        self._layout, self._shapes = layout, shapes
        self._memory = FreeableBuffer(
            layout.buffer_numel,
            dict(layout.offsets),
            shapes,
            dtype,
            device,
            "full gradient",
            check_freed=check_freed,
        )
        self._uninitialized: set[str] = set()
        self._gaps = _gaps(layout, shapes)

    def _allocate(self) -> None:
        if not self._memory.allocated:
            self._memory.allocate()
            self._uninitialized = set(self._shapes)

    def view(self, name: str) -> torch.Tensor:
        """Tensor `name`'s full gradient, initialized (zero if nothing was written yet)."""
        self._allocate()
        view = self._memory.views[name]
        if name in self._uninitialized:
            view.zero_()
            self._uninitialized.discard(name)
        return view

    def accumulate(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """Adds each gradient to its tensor's full gradient (a first one is copied in).

        One foreach copy for the first gradients and one foreach add for the others, so the
        host cost does not grow with a Python call per tensor. `names` has no repeats.
        """
        self._allocate()
        views, fresh = self._memory.views, self._uninitialized
        first = [name in fresh for name in names]
        if any(first):
            foreach_copy_(
                [views[n] for n, f in zip(names, first, strict=True) if f],
                [g for g, f in zip(grads, first, strict=True) if f],
            )
            fresh.difference_update(names)
        if not all(first):
            foreach_add_(
                [views[n] for n, f in zip(names, first, strict=True) if not f],
                [g for g, f in zip(grads, first, strict=True) if not f],
            )

    def for_reduce(self) -> torch.Tensor:
        """The whole buffer, with every range nobody wrote zeroed (one kernel per run)."""
        if not self._memory.allocated:
            raise RuntimeError(
                "no gradient to reduce: write into full_grad(name) or accumulate_grad() first"
            )
        buffer = self._memory.allocate()
        ranges = list(self._gaps)
        for name in self._uninitialized:
            start = self._layout.offsets[name]
            ranges.append((start, start + self._shapes[name].numel()))
        for lo, hi in _merge(ranges):
            buffer[lo:hi].zero_()
        self._uninitialized.clear()
        return buffer

    def zero(self) -> None:
        """Forgets every gradient written so far (lazily: no kernel runs now)."""
        if self._memory.allocated:
            self._uninitialized = set(self._shapes)

    def free(self) -> None:
        """Frees the memory; the views stay the same objects and raise if read meanwhile."""
        self._memory.free()


def _gaps(layout: Layout, shapes: dict[str, torch.Size]) -> list[tuple[int, int]]:
    """Ranges of the global buffer holding no tensor's elements (padding, plan tails).

    A tail: what a tensor smaller than its plan (an uneven tensor-parallel piece) leaves.
    """
    spans = sorted((off, off + shapes[name].numel()) for name, off in layout.offsets.items())
    gaps, end = [], 0
    for lo, hi in spans:
        if lo > end:
            gaps.append((end, lo))
        end = max(end, hi)
    if layout.buffer_numel > end:
        gaps.append((end, layout.buffer_numel))
    return gaps


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted([r for r in ranges if r[1] > r[0]]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged
