"""examples/train.py as a user runs it: bad input, engines agreeing, checkpoint and resume.

One run goes through the command line (`--nproc` spawns the ranks); the others call the same
rank work, `train.run`, on the ranks of the session's RankPool (tests/support/example_runs.py),
and bad input goes through `train.main` in this process: spawning and importing torch for each
of them would cost more than the small runs themselves.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

ROOT = pathlib.Path(__file__).parent.parent
TRAIN = ROOT / "examples" / "train.py"
SMALL = [
    *("--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32"),
    *("--global-batch", "12", "--eval-every", "6", "--sample-chars", "20"),
]


def _record(out: pathlib.Path, args: tuple[str, ...]) -> dict[str, object]:
    engine = args[args.index("--engine") + 1] if "--engine" in args else "ours"
    return json.loads((out / f"{engine}.json").read_text())  # type: ignore[no-any-return]


def _train_command_line(*args: str, out: pathlib.Path) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, str(TRAIN), *SMALL, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # tqdm's multiprocessing lock, left by a rank that ends by os._exit, once made every
    # run end with the resource tracker's warning.
    assert "leaked semaphore" not in result.stderr, result.stderr[-2000:]
    return _record(out, args)


def _train(pools, world: int, *args: str, out: pathlib.Path) -> dict[str, object]:
    from example_runs import train_on_ranks

    pools[world].run(train_on_ranks, [*SMALL, "--out", str(out), *args])
    return _record(out, args)


def _losses(record: dict[str, object]) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in record["train"]}  # type: ignore[attr-defined]


def _exit_code(argv: list[str]) -> int:
    import train

    try:
        return train.main(argv)
    except SystemExit as exc:  # argparse's errors
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "deepspeed"], "invalid choice: 'deepspeed'"),
        (["--data", "/no/such/file.txt"], "data file /no/such/file.txt does not exist"),
        (["--nproc", "5"], "--global-batch 12 does not split over 5 data-parallel replicas"),
        (["--nproc", "2", "--tp", "3"], "--tp 3 must be >= 1 and divide the 2 ranks"),
        (["--nproc", "2", "--tp", "2", "--moe", "4"], "--tp shards dense blocks"),
        (["--nproc", "2", "--ep", "2"], "--ep 2 needs --moe N"),
        (["--nproc", "4", "--tp", "4", "--heads", "2"], "--heads 2 must be a multiple of --tp 4"),
        (["--resume", "{empty}"], "no checkpoint there"),
        (["--seq-len", "2000000"], "longer than the val split"),
        (["--engine", "fsdp2", "--optimizer", "adamw8bit"], "use --engine ours"),
        (["--engine", "fsdp2", "--gather", "fp8"], "--gather fp8 needs shards of whole"),
        (["--optimizer", "lion"], "invalid choice: 'lion'"),
        (["--nproc", "2", "--pp", "3"], "--pp 3 must be >= 1 and divide the 2 ranks"),
        (["--nproc", "2", "--pp", "2", "--tp", "2"], "runs without --tp and --ep"),
        (["--nproc", "4", "--pp", "4", "--layers", "2"], "--pp 4 needs at least as many"),
        (["--nproc", "2", "--pp", "2", "--microbatches", "5"], "--microbatches 5 does not"),
        (["--alternate", "-1"], "--alternate must be >= 0 (rounds), got -1"),
        (["--nproc", "2", "--alternate", "2", "--pp", "2"], "--alternate times plain runs"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, capsys, args, message) -> None:
    args = [a.replace("{empty}", str(tmp_path)) for a in args]
    assert _exit_code([*SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_bad_input_on_the_command_line_is_one_line_and_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, str(TRAIN), *SMALL, "--nproc", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result
    assert "does not split over 5 data-parallel replicas" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_engines_agree_and_resume_on_another_world_size(tmp_path, pools) -> None:
    ours = _train(pools, 2, "--steps", "24", "--engine", "ours", out=tmp_path / "a")
    fsdp2 = _train(pools, 2, "--steps", "24", "--engine", "fsdp2", out=tmp_path / "b")
    checkpoint = tmp_path / "ck"
    # The command line's own launch (`--nproc` spawns the ranks) writes the checkpoint.
    _train_command_line(
        "--nproc", "2", "--steps", "12", "--checkpoint", str(checkpoint), out=tmp_path / "c"
    )
    resumed = _train(pools, 3, "--steps", "24", "--resume", str(checkpoint), out=tmp_path / "d")
    full, theirs, after = _losses(ours), _losses(fsdp2), _losses(resumed)
    assert sorted(after) == list(range(13, 25)), sorted(after)
    # Same model, seed and data; only the order in which ranks' gradients are summed differs.
    for step in range(1, 25):
        assert abs(full[step] - theirs[step]) < 1e-3, (step, full[step], theirs[step])
    for step in range(13, 25):
        assert abs(full[step] - after[step]) < 1e-3, (step, full[step], after[step])
    assert full[24] < full[1] - 0.5  # it learns
    engines = max(abs(full[s] - theirs[s]) for s in range(1, 25))
    resume = max(abs(full[s] - after[s]) for s in range(13, 25))
    print(f"max loss difference: ours vs FSDP2 {engines:.2e}, resumed on 3 ranks {resume:.2e}")


def test_fp8_gathers_train_with_half_the_gathered_bytes(tmp_path, pools) -> None:
    runs = {
        gather: _train(
            pools,
            2,
            *("--steps", "12", "--mixed-precision", "bf16", "--gather", gather),
            out=tmp_path / gather,
        )
        for gather in ("param", "fp8")
    }
    sent = {gather: int(record["gathered_bytes"]) for gather, record in runs.items()}
    assert 0.45 < sent["fp8"] / sent["param"] <= 0.52, sent
    bf16, fp8 = _losses(runs["param"]), _losses(runs["fp8"])
    assert fp8[12] < fp8[1] - 0.5, fp8  # it learns
    assert abs(fp8[12] - bf16[12]) < 0.05 * bf16[12], (fp8[12], bf16[12])
    print(
        f"gathered bytes per step {sent}; loss at step 12: fp8 {fp8[12]:.4f}, bf16 {bf16[12]:.4f}"
    )


@pytest.mark.parametrize("num_experts", [0, 4])
def test_model_builds_every_tensor_on_the_input_device(num_experts) -> None:
    # The meta device stands in for CUDA here: an op mixing it with a CPU tensor fails the same
    # way ("Expected all tensors to be on the same device"). MoE routing's nonzero needs the
    # meta kernel that assumes every element is nonzero.
    import torch
    import torch.fx.experimental._config as fx_config
    from model import Config, Decoder

    model = Decoder(Config(num_experts=num_experts)).to("meta")
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        assert model(tokens).shape == (2, 8, Config().vocab)


@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit"])
def test_optimizers_train_and_resume_on_another_world_size(tmp_path, pools, optimizer) -> None:
    # DCP reshards the optimizer state (Muon's momentum, AdamW8bit's codes and scales) from
    # 2 ranks' layout to 3 ranks'; the resumed run continues the uninterrupted curve.
    args = ("--optimizer", optimizer, "--lr", "1e-2")
    full = _losses(_train(pools, 2, "--steps", "16", *args, out=tmp_path / "a"))
    checkpoint = tmp_path / "ck"
    _train(pools, 2, "--steps", "8", "--checkpoint", str(checkpoint), *args, out=tmp_path / "b")
    resume = ("--steps", "16", "--resume", str(checkpoint))
    after = _losses(_train(pools, 3, *resume, *args, out=tmp_path / "c"))
    assert sorted(after) == list(range(9, 17)), sorted(after)
    for step in range(9, 17):
        assert abs(full[step] - after[step]) < 1e-3, (step, full[step], after[step])
    assert full[16] < full[1] - 0.3  # it learns
    resume = max(abs(full[s] - after[s]) for s in range(9, 17))
    print(f"{optimizer}: max loss difference, resumed on 3 ranks {resume:.2e}")


def test_tensor_and_expert_parallel_runs(tmp_path, pools) -> None:
    # --tp 2 on 4 ranks (dp 2 x tp 2): our engine and FSDP2 on the same mesh, the same losses
    # up to summation order. --ep 2 with 4 experts: the same training as without expert
    # parallelism (each expert on 2 ranks instead of 4), up to summation order.
    tp = ("--tp", "2", "--steps", "6")
    ours = _losses(_train(pools, 4, *tp, "--engine", "ours", out=tmp_path / "a"))
    fsdp2 = _losses(_train(pools, 4, *tp, "--engine", "fsdp2", out=tmp_path / "b"))
    ep = _losses(_train(pools, 4, "--moe", "4", "--ep", "2", "--steps", "6", out=tmp_path / "c"))
    dp = _losses(_train(pools, 4, "--moe", "4", "--steps", "6", out=tmp_path / "d"))
    for step in range(1, 7):
        assert abs(ours[step] - fsdp2[step]) < 1e-4, (step, ours[step], fsdp2[step])
        assert abs(ep[step] - dp[step]) < 1e-3, (step, ep[step], dp[step])
    assert ours[6] < ours[1] - 0.3 and ep[6] < ep[1] - 0.3  # they learn


@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit"])
def test_optimizers_beside_tensor_parallelism(tmp_path, pools, optimizer) -> None:
    # dp 2 x tp 2 against dp 2 alone: the same training (Muon's owners gather each matrix
    # over dp and tp; AdamW8bit's blocks tile each tp piece), up to summation order.
    args = ("--optimizer", optimizer, "--lr", "1e-2", "--steps", "4", "--global-batch", "8")
    tp = _losses(_train(pools, 4, "--tp", "2", *args, out=tmp_path / "a"))
    dp = _losses(_train(pools, 2, *args, out=tmp_path / "b"))
    for step in range(1, 5):
        assert abs(tp[step] - dp[step]) < 1e-3, (step, tp[step], dp[step])


def test_pipeline_parallel_runs_and_resumes_without_it(tmp_path, pools) -> None:
    # --pp 2 on 2 ranks (1F1B) and on 4 (pp 2 x dp 2, GPipe, FSDP2 too): the same training
    # as without pipelining, up to summation order; a checkpoint saved by the pipelined run
    # resumes on 2 ranks without it (the stages keep the blocks' names).
    dp = _losses(_train(pools, 2, "--steps", "8", out=tmp_path / "a"))
    checkpoint = tmp_path / "ck"
    saving = ("--pp", "2", "--steps", "4", "--checkpoint", str(checkpoint))
    pp = _losses(_train(pools, 2, *saving, out=tmp_path / "b"))
    gpipe = ("--pp", "2", "--pp-schedule", "gpipe", "--steps", "4", "--microbatches", "3")
    ppdp = _losses(_train(pools, 4, *gpipe, out=tmp_path / "c"))
    theirs = _losses(_train(pools, 4, *gpipe, "--engine", "fsdp2", out=tmp_path / "d"))
    after = _losses(
        _train(pools, 2, "--steps", "8", "--resume", str(checkpoint), out=tmp_path / "e")
    )
    for step in range(1, 5):
        for name, run in (("pp", pp), ("pp x dp", ppdp), ("fsdp2 pp x dp", theirs)):
            assert abs(run[step] - dp[step]) < 1e-4, (name, step, run[step], dp[step])
    for step in range(5, 9):
        assert abs(after[step] - dp[step]) < 1e-3, (step, after[step], dp[step])
    assert dp[8] < dp[1] - 0.3  # it learns


# -- checkpoints: a kill at any moment loses nothing, a wrong checkpoint is refused ---------------


def _run_command_line(*args: str, out: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TRAIN), *SMALL, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize("engine", ["ours", "fsdp2"])
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, pools, engine) -> None:
    # Checkpoints every 3 steps; rank 1 is SIGKILLed after writing its part of step 6's and
    # before the commit. Step 3's stays complete, step 6's half-written folder loads as
    # nothing, and the run started again with the same command continues from step 3
    # bitwise as if never stopped.
    checkpoint = tmp_path / "ck"
    saving = ("--engine", engine, "--steps", "8", "--checkpoint", str(checkpoint))
    saving = (*saving, "--checkpoint-every", "3")
    killed = _run_command_line(
        "--nproc", "2", *saving, out=tmp_path / "a", RAGGED_FSDP_FAULT="kill-in-save:6:1"
    )
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    assert sorted(p.name for p in checkpoint.iterdir()) == [".step-000006.tmp", "step-000003"]
    assert any((checkpoint / ".step-000006.tmp").glob("*.distcp"))  # killed mid-save indeed
    full = _losses(_train(pools, 2, "--engine", engine, "--steps", "8", out=tmp_path / "b"))
    resumed = _losses(_train(pools, 2, *saving, out=tmp_path / "c"))
    assert sorted(resumed) == list(range(4, 9)), sorted(resumed)
    for step in range(4, 9):
        assert resumed[step] == full[step], (step, resumed[step], full[step])
    assert sorted(p.name for p in checkpoint.iterdir()) == ["step-000006", "step-000008"]


def test_torchrun_restart_continues_from_the_last_checkpoint(tmp_path, pools) -> None:
    # torchrun --max-restarts 1: rank 1 is killed before step 5's forward; torchrun starts
    # both ranks again, which find step 4's checkpoint and train steps 5-12 only, with the
    # losses of an uninterrupted run. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt
    # a store of its own (with torchrun's shared store, 1 restart in 3 hung here on gloo).
    checkpoint = tmp_path / "ck"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", "1", str(TRAIN), *SMALL, "--out", str(tmp_path / "a")),
        *("--steps", "12", "--checkpoint", str(checkpoint), "--checkpoint-every", "2"),
    ]
    env = {
        **os.environ,
        "RAGGED_FSDP_FAULT": "kill-at-step:5:1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr, result.stderr[-2000:]
    restarted = _losses(_record(tmp_path / "a", ()))
    full = _losses(_train(pools, 2, "--steps", "12", out=tmp_path / "b"))
    assert sorted(restarted) == list(range(5, 13)), sorted(restarted)  # 1-4 not trained again
    for step in range(5, 13):
        assert restarted[step] == full[step], (step, restarted[step], full[step])


def test_damaged_or_foreign_checkpoints_are_refused_by_name(tmp_path, pools) -> None:
    checkpoint = tmp_path / "ck"
    _train(pools, 2, "--steps", "4", "--checkpoint", str(checkpoint), out=tmp_path / "a")
    saved = checkpoint / "step-000004"
    refusals = [
        (["--layers", "3"], f"{saved} was saved with --layers 2, this run has 3"),
        (["--heads", "4"], "was saved with --heads 2, this run has 4"),
        (["--lr", "0.1"], "was saved with --lr 0.003, this run has 0.1"),
        (["--optimizer", "adamw"], "was saved with --optimizer 'flat-adamw'"),
        (["--steps", "3"], f"{saved} is at step 4, --steps 3 leaves nothing to train"),
        (["--steps", "4"], "--steps 4 leaves nothing to train"),
    ]
    for args, message in refusals:
        for how in ("--resume", "--checkpoint"):  # explicit, and the newest in the folder
            _expect_refusal(["--steps", "8", how, str(checkpoint), *args], message)
    # 64 bytes flipped inside a tensor record: the digest names the file, before any loading.
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    record = damaged / "step-000004" / "__1_0.distcp"
    data = bytearray(record.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    record.write_bytes(data)
    result = _run_command_line(
        "--nproc", "2", "--steps", "8", "--resume", str(damaged), out=tmp_path / "b"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{record} differs from its digest" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    # A meta.json that does not parse names itself.
    (damaged / "step-000004" / "meta.json").write_text("{not json")
    _expect_refusal(["--resume", str(damaged)], f"{damaged}/step-000004/meta.json: not a")


def _expect_refusal(argv: list[str], message: str) -> None:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _exit_code([*SMALL, *argv]) == 2, argv
    assert message in err.getvalue(), (message, err.getvalue())
    assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()


def test_bad_checkpoint_options_are_refused_before_training(tmp_path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [
        (["--checkpoint", str(a_file)], f"--checkpoint {a_file} is a file; give a folder"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint FOLDER"),
        (["--checkpoint", str(tmp_path), "--checkpoint-every", "-1"], "must be >= 0, got -1"),
        (["--checkpoint", str(tmp_path), "--keep-checkpoints", "0"], "must be >= 1, got 0"),
        (["--resume", str(a_file)], f"--resume {a_file}: no checkpoint there"),
        (["--resume", str(tmp_path)], f"--resume {tmp_path}: no checkpoint there"),
    ]
    for argv, message in cases:
        _expect_refusal(argv, message)


def test_alternated_timing_and_the_report_explain_every_copy(tmp_path, pools, capsys) -> None:
    out = tmp_path / "t"
    from example_runs import train_on_ranks

    pools[2].run(train_on_ranks, [*SMALL, "--out", str(out), "--alternate", "2"])
    timing = json.loads((out / "timing.json").read_text())
    setups = timing["setups"]
    assert [s["label"] for s in setups] == [
        "ours + ragged_optimizers.AdamW",
        "ours + torch.optim.AdamW",
        "FSDP2 + torch.optim.AdamW",
    ]
    assert timing["rounds"] == 2 and timing["world"] == 2
    for setup in setups:
        assert len(setup["round_s"]) == 2
        assert 0 < setup["min_s"] <= setup["median_s"] <= setup["max_s"]
        assert setup["ratio_min"] <= setup["ratio_to_fsdp2"] <= setup["ratio_max"]
    assert setups[2]["ratio_to_fsdp2"] == setups[2]["ratio_min"] == 1.0
    runs = [
        _train(pools, 2, "--steps", "8", "--engine", engine, "--gather", gather, out=folder)
        for engine, gather, folder in (
            ("ours", "param", tmp_path / "a"),
            ("fsdp2", "param", tmp_path / "b"),
            ("ours", "fp8", tmp_path / "c"),
        )
    ]
    import report

    capsys.readouterr()
    files = [str(tmp_path / "a" / "ours.json"), str(tmp_path / "b" / "fsdp2.json")]
    files.append(str(tmp_path / "c" / "ours.json"))
    assert report.main([*files, "--timing", str(out / "timing.json")]) == 0
    text = capsys.readouterr().out
    # Each column names its optimizer; every copy kernel is explained; the step times are
    # the alternated ones, with their spread (one run's step time is not in the table).
    assert "| | ours + ragged_optimizers.AdamW (W=2) | FSDP2 + torch.optim.AdamW (W=2) |" in text
    assert "(not explained here)" not in text
    for run in runs:
        assert run["copies"] and all(" in FSDP::" in key for key in run["copies"]), run
    assert "FSDP2's copy-out" in text and "one kernel per gradient" in text
    assert "| FSDP2 + torch.optim.AdamW | " in text and "1.00 (1.00-1.00) |" in text
    assert "median step" not in text
