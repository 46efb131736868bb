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

import torch

from dbuffer._streams import Stream, current_stream, free_storage
from dbuffer._views import buffer_views
from shard_planner import Layout


class FullGradBuffer:
    """Allocation, lazy initialization and freeing of one DBuffer's global gradient buffer.

    Args:
        layout: The DBuffer's layout.
        shapes: Each tensor's shape.
        dtype: The gradients' dtype.
        device: Their device.
    """

    def __init__(
        self,
        layout: Layout,
        shapes: dict[str, torch.Size],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._layout, self._shapes = layout, shapes
        self._dtype, self._device = dtype, device
        self._buffer: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._stream: Stream | None = None
        self._uninitialized: set[str] = set()
        self._gaps = _gaps(layout)

    @property
    def allocated(self) -> bool:
        """Whether the buffer holds memory (between the first gradient and the reduce)."""
        return self._buffer is not None and self._buffer.untyped_storage().nbytes() > 0

    def _allocate(self) -> None:
        if self._buffer is None:
            self._buffer = torch.empty(
                self._layout.buffer_numel, dtype=self._dtype, device=self._device
            )
            self._views = buffer_views(
                self._buffer, dict(self._layout.offsets), self._shapes, "full gradient"
            )
        elif not self.allocated:
            nbytes = self._buffer.numel() * self._dtype.itemsize
            self._buffer.untyped_storage().resize_(nbytes)  # the views see the new memory
        else:
            return
        self._stream = current_stream(self._device)
        self._uninitialized = set(self._shapes)

    def view(self, name: str) -> torch.Tensor:
        """Tensor `name`'s full gradient, initialized (zero if nothing was written yet)."""
        self._allocate()
        if name in self._uninitialized:
            self._views[name].zero_()
            self._uninitialized.discard(name)
        return self._views[name]

    def accumulate(self, name: str, grad: torch.Tensor) -> None:
        """Adds `grad` to tensor `name`'s full gradient (the first one is copied in)."""
        self._allocate()
        view = self._views[name]
        if name in self._uninitialized:
            view.copy_(grad)
            self._uninitialized.discard(name)
        else:
            view.add_(grad)

    def for_reduce(self) -> torch.Tensor:
        """The whole buffer, with every range nobody wrote zeroed (one kernel per run)."""
        if self._buffer is None or not self.allocated:
            raise RuntimeError(
                "no gradient to reduce: write into full_grad(name) or accumulate_grad() first"
            )
        ranges = list(self._gaps)
        for name in self._uninitialized:
            start = self._layout.offsets[name]
            ranges.append((start, start + self._shapes[name].numel()))
        for lo, hi in _merge(ranges):
            self._buffer[lo:hi].zero_()
        self._uninitialized.clear()
        return self._buffer

    def zero(self) -> None:
        """Forgets every gradient written so far (lazily: no kernel runs now)."""
        if self.allocated:
            self._uninitialized = set(self._shapes)

    def free(self) -> None:
        """Frees the memory; the views stay the same objects and raise if read meanwhile."""
        if self._buffer is not None and self.allocated:
            free_storage(self._buffer, self._stream)


def _gaps(layout: Layout) -> list[tuple[int, int]]:
    """Ranges of the global buffer that belong to no tensor (padding)."""
    spans = sorted((off, off + layout.spec(name).numel) for name, off in layout.offsets.items())
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
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged
