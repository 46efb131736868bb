"""Every touch of a torch internal in dbuffer lives here, behind ragged_placement's version guard.

- `plain_tensor_ops()`: `torch._C.DisableTorchFunctionSubclass`, so that a tensor subclass's
  `__torch_function__` can run an op on its instances as plain tensors (without the default
  handler converting every output to the subclass).
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ragged_placement import check_torch_version

__all__ = ["plain_tensor_ops"]


def plain_tensor_ops() -> AbstractContextManager[None]:
    """Context in which `__torch_function__` overrides of tensor subclasses are skipped."""
    return torch._C.DisableTorchFunctionSubclass()


check_torch_version("dbuffer")
