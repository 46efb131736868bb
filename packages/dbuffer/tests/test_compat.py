"""dbuffer's torch internals, on the torch version under test."""

import pytest
import torch

from dbuffer import _compat


def test_running_torch_is_supported() -> None:
    assert _compat.torch_version() in _compat.SUPPORTED_TORCH, torch.__version__


def test_unsupported_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(
        ImportError, match=r"dbuffer supports torch 2\.13, 2\.14; found torch 2\.99\.0"
    ):
        _compat.check_torch_version()


def test_plain_tensor_ops_skips_subclass_overrides() -> None:
    calls = []

    class Recorded(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func)
            with _compat.plain_tensor_ops():
                return func(*args, **(kwargs or {}))

    x = torch.ones(3).as_subclass(Recorded)
    out = x + 1
    assert len(calls) == 1 and type(out) is torch.Tensor  # outputs stay plain
    with _compat.plain_tensor_ops():
        x.sum()
    assert len(calls) == 1  # the override is skipped inside the context
