"""Every touch of a torch internal in dbuffer lives here, behind a version guard.

- `plain_tensor_ops()`: `torch._C.DisableTorchFunctionSubclass`, so that a tensor subclass's
  `__torch_function__` can run an op on its instances as plain tensors (without the default
  handler converting every output to the subclass).
Tested on torch 2.13 and 2.14 (`nox -s tests`); other versions are refused at import.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

__all__ = ["SUPPORTED_TORCH", "check_torch_version", "plain_tensor_ops", "torch_version"]

SUPPORTED_TORCH = ((2, 13), (2, 14))


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    """Raises ImportError on a torch version this package was not tested on."""
    if torch_version() not in SUPPORTED_TORCH:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
        raise ImportError(f"dbuffer supports torch {supported}; found torch {torch.__version__}")


def plain_tensor_ops() -> AbstractContextManager[None]:
    """Context in which `__torch_function__` overrides of tensor subclasses are skipped."""
    return torch._C.DisableTorchFunctionSubclass()


check_torch_version()
