"""Host work of a step on the fake process group (W=8), each check in a fresh interpreter."""

import os
import subprocess
import sys

import pytest


def _run(check: str, *args: str, **env: str) -> None:
    code = f"import overhead_cases as c; c.main({check!r}, *{args!r})"
    base = {k: v for k, v in os.environ.items() if k != "DBUFFER_CHECK_FREED"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", **env},
    )
    # A crash (reading freed memory) shows as a negative status, not as a dead test run.
    assert result.returncode == 0 and "ok" in result.stdout, (
        result.returncode,
        result.stderr[-3000:],
    )


def test_python_calls_per_step_do_not_grow_with_parameters() -> None:
    _run("check_calls_do_not_grow_with_parameters")


def test_varying_unused_experts_run_no_sharding_propagation() -> None:
    _run("check_varying_unused_experts_propagate_nothing")


@pytest.mark.parametrize("mode", ["debug", "default"])
def test_stale_unsharded_parameter_raises(mode: str) -> None:
    env = {"DBUFFER_CHECK_FREED": "1"} if mode == "debug" else {}
    _run("check_stale_full_view", mode, **env)
