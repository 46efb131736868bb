"""Hugging Face accelerate's FSDP2 path with ours swapped in, against the same run with FSDP2.

accelerate (PyPI 1.15) is installed by nox's newest torch session only. Each run is
`accelerate_train.py` under torchrun on gloo ranks (see its docstring: the one line that lets
accelerate's FSDP path run on CPU, the same for both engines): `Accelerator.prepare` shards a
tiny transformers Llama with accelerate's own `fsdp2_prepare_model`, trains with AdamW, a
learning-rate schedule and `clip_grad_norm_`, and saves / loads its state.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("accelerate", reason="accelerate is installed by nox's newest torch session")
pytest.importorskip("transformers")

RUNNER = pathlib.Path(__file__).with_name("accelerate_train.py")
STEPS = 5


@functools.cache
def _run(engine: str, *args: str, world: int = 2) -> dict:
    """rank 0's report of one run (cached: several tests compare against the same baseline)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={world}", str(RUNNER), "--engine", engine, *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("ACCELERATE_RESULT ")]
    assert len(lines) == 1, result.stdout[-3000:]
    reports = json.loads(lines[0].split(" ", 1)[1])
    assert sorted(r["rank"] for r in reports) == list(range(world)), result.stdout[-3000:]
    assert all(r["losses"] == reports[0]["losses"] for r in reports), reports
    return reports[0]


def _assert_close(ours: list[float], theirs: list[float], tolerance: float) -> None:
    assert len(ours) == len(theirs) > 0, (ours, theirs)
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, theirs, strict=True))
    assert worst <= tolerance, f"worst difference {worst:.2e}: {ours} vs {theirs}"


@pytest.mark.parametrize("world", [2, 3])
def test_trains_equal_to_accelerate_with_fsdp2(world) -> None:
    args = ("--steps", str(STEPS))
    fsdp2, ours = _run("fsdp2", *args, world=world), _run("ours", *args, world=world)
    # accelerate's isinstance walks found ours as FSDP modules: the decoder layers its
    # auto-wrap policy picked, the embedding, the [norm, lm_head] tail and the root.
    assert ours["fsdp_modules"] == fsdp2["fsdp_modules"], (ours, fsdp2)
    assert ours["fsdp_modules"].count("FSDPLlamaDecoderLayer") == 3, ours
    assert len(ours["losses"]) == STEPS
    _assert_close(ours["losses"], fsdp2["losses"], 1e-5)
    _assert_close(ours["grad_norms"], fsdp2["grad_norms"], 1e-5)


def test_bf16_mixed_precision_trains_as_fsdp2() -> None:
    args = ("--steps", str(STEPS), "--mixed-precision", "bf16")
    fsdp2, ours = _run("fsdp2", *args), _run("ours", *args)
    # bf16 gathers and reductions in a different order: bf16-level differences. The losses
    # are bf16 values (a step of 2**-7 relative near 4): allow two steps.
    _assert_close(ours["grad_norms"], fsdp2["grad_norms"], 1e-3)
    _assert_close(ours["losses"], fsdp2["losses"], 2 * 2**-7)


def test_cpu_ram_efficient_loading_takes_rank_0s_weights() -> None:
    # Ranks other than 0 build the model from other seeds; accelerate moves it to the meta
    # device, shards it, broadcasts rank 0's values and `load_state_dict(assign=True)`s them.
    efficient = _run("ours", "--steps", str(STEPS), "--cpu-ram-efficient-loading")
    _assert_close(efficient["losses"], _run("fsdp2", "--steps", str(STEPS))["losses"], 1e-5)
    _assert_close(efficient["grad_norms"], _run("ours", "--steps", str(STEPS))["grad_norms"], 0.0)


@pytest.mark.parametrize(
    ("saver", "loader"), [("ours", "ours"), ("fsdp2", "ours"), ("ours", "fsdp2")]
)
def test_save_state_load_state_resumes_exactly(tmp_path_factory, saver, loader) -> None:
    uninterrupted = _run(loader, "--steps", str(STEPS))
    saved = 3
    folder = str(tmp_path_factory.getbasetemp() / f"accelerate_state_{saver}")  # one save each
    first = _run(saver, "--steps", str(saved), "--save-state", folder)
    resume = ("--steps", str(STEPS - saved), "--load-state", folder, "--skip-steps", str(saved))
    resumed = _run(loader, *resume)
    assert first["losses"] == _run(saver, "--steps", str(STEPS))["losses"][:saved]
    # Model, AdamW state, scheduler and data position all came back: the remaining steps are
    # the uninterrupted run's, bit for bit (one engine) or to fp32 rounding (across engines).
    tolerance = 0.0 if saver == loader else 1e-6
    _assert_close(resumed["losses"], uninterrupted["losses"][saved:], tolerance)
    _assert_close(resumed["grad_norms"], uninterrupted["grad_norms"][saved:], tolerance)
