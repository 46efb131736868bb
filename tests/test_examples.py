"""examples/train.py as a user runs it: bad input, engines agreeing, checkpoint and resume.

One run goes through the command line (`--nproc` spawns the ranks); the others call the same
rank work, `train.run`, on the ranks of the session's RankPool (tests/support/example_runs.py),
and bad input goes through `train.main` in this process: spawning and importing torch for each
of them would cost more than the small runs themselves.
"""

from __future__ import annotations

import json
import pathlib
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
