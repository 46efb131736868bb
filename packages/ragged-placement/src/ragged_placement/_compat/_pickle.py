"""Pickling and deep-copying a DTensor whose local tensor is a piece of a larger storage.

torch serializes a DTensor as a wrapper (type, shape, strides, storage offset) plus its
attributes, the local tensor among them; it takes that path only when the wrapper's
`data_ptr()` is 0. Since torch 2.11 the wrapper copies its local tensor's storage offset, so
a DTensor over `buffer[8:16]` has a non-zero data pointer and torch tries to save the
wrapper's own storage, which does not exist ("Attempted to access the data pointer on an
invalid python storage"); `copy.deepcopy` fails the same way. Every parameter of a DBuffer
after its first, and every view of a flat optimizer state, is such a DTensor.

So a DTensor whose local tensor does not own its storage (an offset, or a storage holding
more than the piece) is pickled and deep-copied as a DTensor over a copy of its piece alone:
what FSDP2's DTensors (each over a storage of its own) pickle as, and what a user expects of
`torch.save(model.state_dict())` (one rank's pieces, not the whole flat shard once per
tensor). DTensors over storages of their own take torch's path unchanged. Object identity is
kept by pickle's and deepcopy's memos (a tied weight is saved once), as for any tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_SLOTS = ("_local_tensor", "_spec")  # attributes (slots since torch 2.13) set by __new__


def owns_storage(local: torch.Tensor) -> bool:
    """Whether `local` spans its whole storage from offset 0 (pickling it saves just it).

    Example:
        >>> owns_storage(torch.zeros(4)), owns_storage(torch.zeros(8)[2:6])
        (True, False)
    """
    if local.storage_offset() != 0:
        return False
    return local.untyped_storage().nbytes() == local.numel() * local.element_size()


def _piece_of_its_own(dt: DTensor) -> DTensor | None:
    """`dt` over a copy of its local piece, or None where torch's own path works."""
    local = getattr(dt, "_local_tensor", None)
    if type(dt) is not DTensor or type(local) is not torch.Tensor or owns_storage(local):
        return None
    with torch.no_grad():
        piece = local.clone()
    twin: DTensor = DTensor.__new__(DTensor, piece, dt._spec, requires_grad=dt.requires_grad)
    # Other attributes (`_is_param` of a parameter) travel as torch's path carries them.
    twin.__dict__.update((k, v) for k, v in dt.__dict__.items() if k not in _SLOTS)
    return twin


def patch_pickling() -> None:
    """`DTensor.__reduce_ex__` and `__deepcopy__`: a piece of a larger storage as its own."""
    original_reduce: Callable[[DTensor, Any], Any] = DTensor.__reduce_ex__
    original_deepcopy: Callable[[DTensor, dict[int, Any]], Any] = DTensor.__deepcopy__

    def __reduce_ex__(self: DTensor, proto: Any) -> Any:  # noqa: N807
        twin = _piece_of_its_own(self)
        return original_reduce(self if twin is None else twin, proto)

    def __deepcopy__(self: DTensor, memo: dict[int, Any]) -> Any:  # noqa: N807
        found = memo.get(id(self))
        if found is not None:
            return found
        twin = _piece_of_its_own(self)
        if twin is None:
            return original_deepcopy(self, memo)
        # The twin's piece is already a copy: deep-copy the rest as torch would.
        twin._spec = copy.deepcopy(self._spec, memo)
        twin.__dict__.update(copy.deepcopy(dict(twin.__dict__), memo))
        if self.grad is not None:
            twin.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = twin
        return twin

    setattr(DTensor, "__reduce_ex__", __reduce_ex__)  # noqa: B010
    setattr(DTensor, "__deepcopy__", __deepcopy__)  # noqa: B010
