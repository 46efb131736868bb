"""FreeableBuffer: a flat buffer whose memory comes and goes under views of fixed identity.

Both of a DBuffer's global buffers work this way: the unsharded parameters (freed by
`reshard()`) and the full gradients (freed by `reduce_scatter()`). The views are made once;
freeing resizes the storage to zero bytes (on CUDA after the allocating stream has waited for
the freeing one, `_streams.py`), and re-allocating resizes it back on the current stream, so
the same view objects see the new memory. Reading a view in between raises (`_views.py`).

Writers (the collectives, the mixed-precision cast, gradient zeroing) go through a second alias
of the storage with a version counter of its own (`allocate()` returns it). Autograd checks the
version counter of every tensor it saved: forward may save an unsharded parameter, the buffer
is freed after forward and gathered again for backward, and that gather must not look like an
in-place change of what forward saved (FSDP2 keeps the counter the same way around its
all-gather copy-out).

With `backing` (a DBuffer on one rank: the global buffer is the local shard), the buffer is an
alias of that memory: allocating and freeing only flip a flag, which the views check as they
would a freed storage, so code that reads a resharded view fails the same way on one rank as
on many.
"""

from __future__ import annotations

import torch

from dbuffer._streams import Stream, current_stream, free_storage
from dbuffer._views import buffer_views


class FreeableBuffer:
    """`numel` elements of `dtype` on `device`, with one guarded view per tensor.

    Args:
        numel: Elements in the buffer.
        offsets: Global start of each tensor.
        shapes: Shape of each tensor.
        dtype: The buffer's dtype.
        device: Its device.
        what: How errors name the views ("unsharded tensor", "full gradient").
        backing: Memory to alias instead of allocating (`numel` elements of `dtype`).
    """

    def __init__(
        self,
        numel: int,
        offsets: dict[str, int],
        shapes: dict[str, torch.Size],
        dtype: torch.dtype,
        device: torch.device,
        what: str,
        backing: torch.Tensor | None = None,
    ) -> None:
        self._numel, self._offsets, self._shapes = numel, offsets, shapes
        self._dtype, self._device, self._what = dtype, device, what
        if backing is not None and (backing.numel() != numel or backing.dtype != dtype):
            raise ValueError(
                f"backing must hold {numel} elements of {dtype}, got {backing.numel()} of "
                f"{backing.dtype}"
            )
        self._backing = backing
        self._live = False  # with a backing: whether the buffer counts as allocated
        self._tensor: torch.Tensor | None = None
        self._writer: torch.Tensor | None = None
        self.views: dict[str, torch.Tensor] = {}
        self._stream: Stream | None = None

    @property
    def allocated(self) -> bool:
        """Whether the buffer holds memory now (an empty buffer always does)."""
        if self._backing is not None:
            return self._live
        t = self._tensor
        return t is not None and (t.numel() == 0 or t.untyped_storage().nbytes() > 0)

    def allocate(self) -> torch.Tensor:
        """The whole buffer, allocating (uninitialized) memory on the current stream if needed.

        Returns:
            A flat alias of the buffer for writing: it shares the memory of the views but not
            their version counter, so writes through it leave autograd's saved views valid.
        """
        if self._tensor is None or self._writer is None:
            if self._backing is not None:
                # Own version counter here too: the shard's in-place optimizer updates are
                # not in-place changes of what forward saved (as on many ranks).
                self._tensor = _alias(self._backing)
            else:
                self._tensor = torch.empty(self._numel, dtype=self._dtype, device=self._device)
            self.views = buffer_views(
                self._tensor, self._offsets, self._shapes, self._what, memory=self
            )
            self._writer = _alias(self._tensor)
            self._stream = current_stream(self._device)
        elif self._backing is None and not self.allocated:
            self._tensor.untyped_storage().resize_(self._numel * self._dtype.itemsize)
            self._stream = current_stream(self._device)
        self._live = True
        return self._writer

    def free(self) -> None:
        """Frees the memory; the views stay the same objects and raise if read meanwhile."""
        if self._backing is not None:
            self._live = False
        elif self._tensor is not None and self.allocated and self._numel:
            free_storage(self._tensor, self._stream)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor set to `tensor`'s storage: one memory, its own version counter."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))
    return alias
