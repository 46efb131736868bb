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

Reading freed memory: by default the views are plain tensors, so an op on them costs what it
costs on any tensor (a GPU step of a model with many small parameters is bound by exactly that
host time). What stays checked by default, at no cost per op:
- autograd: freeing moves the views' shared version counter one ahead and re-allocating moves
  it back, so a backward that needs a view autograd saved while its memory is freed raises
  autograd's own error ("modified by an inplace operation ... is at version v+1; expected
  version v") instead of reading freed memory;
- the owner's accessors (`DBuffer.full`) raise while the memory is freed.
An op on a view obtained earlier and read while freed is undefined (a segfault on CPU, an
illegal access on CUDA), as it is for torch FSDP2's unsharded parameters. With `check_freed`
(`DBUFFER_CHECK_FREED=1` in the environment) the views are guarded (`_views.py`): every op
checks the memory first and raises a clear error, for about 10 us per op.

With `backing` (a DBuffer on one rank: the global buffer is the local shard), the buffer is an
alias of that memory: allocating and freeing only flip a flag (and the version counter), which
guarded views check as they would a freed storage, so code that reads a resharded view fails
the same way on one rank as on many.
"""

from __future__ import annotations

import os

import torch

from dbuffer._compat import set_version, version_of
from dbuffer._streams import Stream, current_stream, free_storage
from dbuffer._views import buffer_views

CHECK_FREED = "DBUFFER_CHECK_FREED"


def check_freed_default() -> bool:
    """Whether views are guarded when the caller does not say: `DBUFFER_CHECK_FREED=1`."""
    return os.environ.get(CHECK_FREED, "0") == "1"


class FreeableBuffer:
    """`numel` elements of `dtype` on `device`, with one view per tensor.

    Args:
        numel: Elements in the buffer.
        offsets: Global start of each tensor.
        shapes: Shape of each tensor.
        dtype: The buffer's dtype.
        device: Its device.
        what: How errors name the views ("unsharded tensor", "full gradient").
        backing: Memory to alias instead of allocating (`numel` elements of `dtype`).
        check_freed: Guard the views: every op on one checks that the memory is there
            (slower; for debugging).
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
        check_freed: bool = False,
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
        self._check_freed = check_freed
        self._version = 0  # the views' version while allocated

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
                self._tensor,
                self._offsets,
                self._shapes,
                self._what,
                memory=self if self._check_freed else None,
            )
            self._writer = _alias(self._tensor)
            self._stream = current_stream(self._device)
        elif not self.allocated:
            if self._backing is None:
                self._tensor.untyped_storage().resize_(self._numel * self._dtype.itemsize)
                self._stream = current_stream(self._device)
            set_version(self._tensor, self._version)  # what autograd saved is valid again
        self._live = True
        return self._writer

    def free(self) -> None:
        """Frees the memory; the views stay the same objects (see the module docstring)."""
        tensor = self._tensor
        if tensor is None or not self.allocated:
            return
        if self._backing is not None:
            self._live = False
        elif self._numel:
            free_storage(tensor, self._stream)
        else:
            return  # nothing to free, nothing to read
        # Saved views fail autograd's version check until the memory is back.
        self._version = version_of(tensor)
        set_version(tensor, self._version + 1)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor set to `tensor`'s storage: one memory, its own version counter."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))
    return alias
