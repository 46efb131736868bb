"""torchtitan's trainer with ours swapped in for FSDP2, against the same run with FSDP2.

torchtitan (PyPI 0.3.0) is installed by nox's newest torch session only: it needs torch >=
2.14 (its default SPMD backend imports spmd_types, its FSDP code names 2.14+ symbols). Each
run is `torchtitan_train.py` under torchrun on 2 gloo ranks (see its docstring for the
CPU shims, the same for both engines); every run starts from one seed checkpoint that
torchtitan writes on one rank (`create_seed_checkpoint`), because FSDP2's own initialization
on a CPU mesh draws each rank's shard from the same generator state (DTensor's random ops
need a CUDA-like device), where ours draws as one process: from the same weights, the two
runs are compared step by step.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if _TORCH < (2, 14):
    pytest.skip("torchtitan 0.3.0 needs torch >= 2.14", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is installed by nox's newest torch session")

import torchtitan_train  # noqa: E402  (after the skips: it imports torch.distributed)

RUNNER = pathlib.Path(torchtitan_train.__file__)
STEPS = 10


def _run(folder: pathlib.Path, name: str, *args: str, world: int = 2) -> list[dict]:
    """Runs the trainer under torchrun; returns rank 0's logged steps (ranks must agree)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={world}", str(RUNNER), "--assets", str(folder / "assets")]
    command += ["--dump-folder", str(folder / name), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    reports = [
        json.loads(line.split(" ", 1)[1])
        for line in result.stdout.splitlines()
        if line.startswith("TORCHTITAN_RESULT ")
    ]
    if "--seed-checkpoint" in args:
        return []
    assert len(reports) == world, result.stdout[-3000:]
    assert all(r["steps"] == reports[0]["steps"] for r in reports), reports
    return reports[0]


def _seed(folder: pathlib.Path, model: str) -> list[str]:
    """torchtitan's seed checkpoint for `model` (one rank); the arguments that start from it."""
    name = f"seed_{model}"
    _run(folder, name, "--engine", "fsdp2", "--model", model, "--seed-checkpoint", world=1)
    return ["--model", model, "--initial-load", str(folder / name / "checkpoint" / "step-0")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("torchtitan")
    torchtitan_train.write_assets(str(folder / "assets"))
    return folder


@pytest.fixture(scope="module")
def runs(folder: pathlib.Path) -> dict[str, dict]:
    """llama3's debug model: fp32 and bf16 with both engines, and ours resumed at step 5."""
    start = [*_seed(folder, "llama3"), "--steps", str(STEPS)]
    runs = {
        engine: _run(folder, engine, "--engine", engine, *start, "--checkpoint-interval", "5")
        for engine in ("fsdp2", "ours")
    }
    # Resumed at step 5 by ours, from its own checkpoint and from FSDP2's.
    for source in ("fsdp2", "ours"):
        name = f"ours_from_{source}"
        shutil.copytree(
            folder / source / "checkpoint" / "step-5", folder / name / "checkpoint" / "step-5"
        )
        runs[f"resume_{source}"] = _run(
            folder,
            name,
            "--engine",
            "ours",
            *start,
            "--checkpoint-interval",
            "5",
            "--load-step",
            "5",
        )
    for engine in ("fsdp2", "ours"):
        name = f"bf16_{engine}"
        runs[name] = _run(folder, name, "--engine", engine, *start, "--dtype", "bfloat16")
    return runs


def _worst(ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs), (ours, theirs)
    return max(abs(a - b) for a, b in zip(ours, theirs, strict=True))


def _losses(report: dict) -> list[float]:
    return [step["loss"] for step in report["steps"]]


def test_finds_our_modules_as_fsdp2_modules(runs: dict[str, dict]) -> None:
    """torchtitan's isinstance walks (divide factor, chunked loss) see the same 10 modules."""
    assert runs["ours"]["class"] == "fsdp_engine._module"
    assert runs["fsdp2"]["class"].startswith("torch.distributed.fsdp")
    assert runs["ours"]["num_fsdp_modules"] == runs["fsdp2"]["num_fsdp_modules"] == 10


def test_losses_equal_fsdp2_in_float32(runs: dict[str, dict]) -> None:
    ours, fsdp2 = _losses(runs["ours"]), _losses(runs["fsdp2"])
    assert len(ours) == len(fsdp2) == STEPS
    worst = _worst(ours, fsdp2)
    print(f"llama3 fp32: max |loss - FSDP2's| over {STEPS} steps {worst:.2e}; {ours}")
    assert worst < 1e-4, (ours, fsdp2)
    assert ours[-1] < ours[0] - 0.5, ours  # it learns


def test_divide_factor_is_applied(runs: dict[str, dict]) -> None:
    """torchtitan sets a divide factor of 1 on every FSDP module it finds (it scales the loss
    by the global token count itself): left at the world size, ours would halve every
    gradient, and the gradient norm it logs would be half FSDP2's."""
    for ours, fsdp2 in zip(runs["ours"]["steps"], runs["fsdp2"]["steps"], strict=True):
        assert ours["grad_norm"] == pytest.approx(fsdp2["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("source", ["ours", "fsdp2"])
def test_resume_from_a_checkpoint(runs: dict[str, dict], source: str) -> None:
    """Steps 6-10 after loading step 5's full training state (model, AdamW, scheduler, data
    loader) equal the uninterrupted run's, from our checkpoint and from FSDP2's."""
    resumed = runs[f"resume_{source}"]["steps"]
    assert [s["step"] for s in resumed] == list(range(6, STEPS + 1))
    expected = _losses(runs["ours"])[5:]
    got = _losses(runs[f"resume_{source}"])
    worst = _worst(got, expected)
    print(f"resumed from {source}'s step 5: max |loss - uninterrupted| {worst:.2e}")
    assert worst < 1e-5, (got, expected)


def test_losses_equal_fsdp2_in_bfloat16(runs: dict[str, dict]) -> None:
    ours, fsdp2 = _losses(runs["bf16_ours"]), _losses(runs["bf16_fsdp2"])
    assert len(ours) == len(fsdp2) == STEPS
    worst = _worst(ours, fsdp2)
    print(f"llama3 bf16: max |loss - FSDP2's| over {STEPS} steps {worst:.2e}")
    assert worst < 5e-4, (ours, fsdp2)


def test_moe_debug_model_equals_fsdp2(folder: pathlib.Path) -> None:
    """DeepSeek-V3's debug model (a dense layer, then MoE layers with 8 routed and 2 shared
    experts, top-3 routing), in fp32: the same losses as FSDP2, step by step."""
    start = [*_seed(folder, "deepseek_v3"), "--steps", "6"]
    fsdp2 = _losses(_run(folder, "ds_fsdp2", "--engine", "fsdp2", *start))
    ours = _losses(_run(folder, "ds_ours", "--engine", "ours", *start))
    assert len(ours) == 6, ours
    worst = _worst(ours, fsdp2)
    print(f"deepseek_v3 fp32: max |loss - FSDP2's| over 6 steps {worst:.2e}")
    assert worst < 1e-4, (ours, fsdp2)


def test_expert_parallel_plain_parameters_are_refused(folder: pathlib.Path) -> None:
    """With expert parallelism torchtitan's default backend hands fully_shard plain expert
    weights annotated Shard(0) on an `ep` axis: ours refuses them by name at build time
    rather than checkpointing each rank's experts as the whole tensor. (FSDP2's run needs
    uneven all-to-alls, which gloo does not have.)"""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(RUNNER), "--assets", str(folder / "assets")]
    command += ["--dump-folder", str(folder / "ep"), "--engine", "ours"]
    command += ["--model", "deepseek_v3", "--ep", "2", "--steps", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode != 0
    assert "non-data axes ['ep']" in result.stderr + result.stdout, result.stderr[-3000:]
