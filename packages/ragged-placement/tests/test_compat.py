"""The torch hooks: version guard and installation, on the torch version under test."""

import pytest
import torch
import torch.distributed.tensor as dtensor_pkg
import torch.distributed.tensor._redistribute as dtensor_redistribute

import ragged_placement  # noqa: F401  (installs the hooks)
from ragged_placement import _compat


def test_running_torch_is_supported_and_hooks_are_installed() -> None:
    assert _compat.torch_version() in _compat.SUPPORTED_TORCH, torch.__version__
    # Each hook wraps torch's original (functools.wraps keeps the original reachable).
    for fn in (
        dtensor_redistribute.redistribute_local_tensor,
        dtensor_pkg.distribute_tensor,
        dtensor_pkg.DTensor.from_local,
    ):
        assert hasattr(fn, "__wrapped__"), fn


def test_unsupported_version_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(ImportError, match=r"supports torch 2\.13, 2\.14; found torch 2\.99\.0"):
        _compat.check_torch_version()


def test_install_is_idempotent() -> None:
    before = dtensor_redistribute.redistribute_local_tensor
    _compat.install(object())  # type: ignore[arg-type]  (already installed: returns at once)
    assert dtensor_redistribute.redistribute_local_tensor is before
