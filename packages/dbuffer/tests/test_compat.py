"""dbuffer's torch internals, on the torch version under test."""

import subprocess
import sys

import torch

from dbuffer import _compat
from ragged_placement import SUPPORTED_TORCH


def test_running_torch_is_supported() -> None:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert (major, minor) in SUPPORTED_TORCH, torch.__version__


def test_unsupported_version_is_refused_at_import() -> None:
    # ragged_placement's guard (imported first by dbuffer) refuses, naming the versions.
    result = subprocess.run(
        [sys.executable, "-c", "import torch; torch.__version__ = '2.99.0'; import dbuffer"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "supports torch 2.13, 2.14; found torch 2.99.0" in result.stderr, result.stderr


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
