"""fsdp_engine's torch internals, on the torch version under test."""

import subprocess
import sys

import torch

from fsdp_engine import _compat


def test_backward_callback_runs_once_after_the_backward_pass() -> None:
    events: list[str] = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        events.append("hook")
        _compat.queue_backward_callback(lambda: events.append("end"))
        return grad

    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    assert events == ["hook", "end"], events
    y2 = x * 3
    y2.sum().backward()
    assert events == ["hook", "end"], events  # queued for one backward pass only


def test_unsupported_version_is_refused_at_import() -> None:
    code = "import torch; torch.__version__ = '2.99.0'; import fsdp_engine"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "supports torch 2.13, 2.14; found torch 2.99.0" in result.stderr, result.stderr


def test_profiler_range_only_under_a_profiler() -> None:
    from torch.profiler import profile, record_function

    idle = _compat.profiler_range("FSDP::test")
    assert not isinstance(idle, record_function)  # no profiler: a no-op context, no range
    with idle:
        pass
    with profile() as prof, _compat.profiler_range("FSDP::test"):
        torch.ones(2).sum()
    assert any(e.name == "FSDP::test" for e in prof.events())
