import json
import subprocess
import sys

import pytest

from shard_planner import Layout, load_plan, load_preset
from shard_planner._cli import main


def test_compare_prints_a_row_per_case(capsys) -> None:
    assert (
        main(
            [
                "compare",
                "--preset",
                "gpt-oss-120b",
                "--world-sizes",
                "8,256",
                "--block-rows",
                "1,16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 4
    # At 256 ranks FSDP2 pads the 128-expert tensors to 256 rows; ours stays near zero.
    w256 = next(r for r in rows if r.split()[:2] == ["256", "1"]).split()
    assert float(w256[2].rstrip("%")) < 1.0 < float(w256[4].rstrip("%"))


def test_plan_writes_layout_json_that_round_trips(tmp_path, capsys) -> None:
    out = tmp_path / "layout.json"
    argv = [
        "plan",
        "--preset",
        "llama3-8b",
        "--group",
        "model.layers.0",
        "--world-size",
        "6",
        "--block-rows",
        "32",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    (layout,) = load_plan(out.read_text()).values()
    assert layout.world_size == 6 and len(layout.tensors) == 9
    assert main(["show", "--layout", str(out), "--max-ranks", "2"]) == 0
    assert "rank     1:" in capsys.readouterr().out


def test_plan_of_several_groups_is_one_format_that_show_reads(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "llama3-8b", "--world-size", "4", "--out", str(out)]
    assert main(argv) == 0
    layouts = load_plan(out.read_text())
    assert len(layouts) == len(load_preset("llama3-8b").groups)
    assert main(["show", "--layout", str(out), "--group", "model.layers.3"]) == 0
    assert "world_size=4" in capsys.readouterr().out
    with pytest.raises(ValueError, match="this is a plan of 34 group"):
        Layout.from_json(out.read_text())


def test_plan_summary_from_a_group_file(tmp_path, capsys) -> None:
    path = tmp_path / "g.json"
    path.write_text(
        json.dumps(
            {"tensors": [{"name": "a", "numel": 100, "block": 10}, {"name": "b", "shape": [7, 3]}]}
        )
    )
    assert main(["plan", str(path), "--world-size", "4", "--block-rows", "2"]) == 0
    assert "2 tensors, 121 elements" in capsys.readouterr().out


ESTIMATE_8B = ["estimate", "--preset", "llama3-8b", "--shard-size", "8"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--preset", "nope"], "unknown preset 'nope'"),
        (["plan", "--preset", "llama3-8b", "--world-size", "0"], "must be >= 1, got 0"),
        (
            ["plan", "--preset", "llama3-8b", "--world-size", "2", "--block-rows", "0"],
            "must be >= 1",
        ),
        (["plan", "/no/such/file.json", "--world-size", "2"], "cannot read /no/such/file.json"),
        (["show", "--preset", "llama3-8b", "--group", "nope"], "no group named 'nope'"),
        (["compare", "--preset", "llama3-8b", "--world-sizes", ","], "comma-separated list"),
        (
            ["plan", "--preset", "llama3-8b", "--world-size", "2", "--out", "/no/dir/x.json"],
            "cannot write /no/dir/x.json: folder /no/dir does not exist",
        ),
        (
            ["plan", "--preset", "llama3-8b", "--world-size", "2", "--out", "/tmp"],
            "cannot write /tmp: it is a directory",
        ),
        (
            ["show", "--preset", "llama3-8b", "--out", "/no/dir/x.png"],
            "cannot write /no/dir/x.png: folder /no/dir does not exist",
        ),
        (
            ["compare", "--preset", "llama3-8b", "--world-sizes", "8", "--plot", "/no/d/x.png"],
            "cannot write /no/d/x.png: folder /no/d does not exist",
        ),
        (
            ["plan", "some.json", "--preset", "llama3-8b", "--world-size", "2"],
            "give a group file or --preset, not both",
        ),
        (["compare"], "give a group file or --preset NAME"),
        (
            ["estimate", "--preset", "llama3-8b", "--shard-size", "8", "--optimizer", "lamb"],
            "invalid choice: 'lamb'",
        ),
        (
            [
                "advise",
                "--preset",
                "llama3-8b",
                "--ranks",
                "64",
                "--memory-gb",
                "80",
                "--optimizer",
                "adamw8bit",
                "--block-rows",
                "16",
            ],
            "block_rows must be a multiple of 32, got 16",
        ),
        (["advise", "--preset", "llama3-8b", "--ranks", "64"], "--memory-gb"),
        (
            ["estimate", "--preset", "llama3-8b", "--shard-size", "8", "--param-bytes", "3"],
            "param_bytes must be 1, 2, 4 or 8",
        ),
        (
            ["advise", "--preset", "llama3-8b", "--ranks", "8", "--memory-gb", "x"],
            "expected a number, got 'x'",
        ),
        (
            ["estimate", "--preset", "llama3-8b", "--shard-size", "8", "--inter-node-gbps", "inf"],
            "must be a finite number >= 0, got 'inf'",
        ),
        (
            [
                "advise",
                "--preset",
                "llama3-8b",
                "--ranks",
                "8",
                "--memory-gb",
                "80",
                "--expert-groups",
                "x",
            ],
            "expected a comma-separated list of integers >= 0, got 'x'",
        ),
        (
            [*ESTIMATE_8B, "--seq-len", "8", "--checkpointing", "--checkpoint-ratio", "5/4"],
            "expected P/Q with integers 1 <= P <= Q <= 64 (e.g. 3/4), got '5/4'",
        ),
        (
            [*ESTIMATE_8B, "--seq-len", "8", "--loss-bytes-per-logit", "-1"],
            "must be in [0, 1024], got -1",
        ),
        (
            [*ESTIMATE_8B, "--seq-len", "8192", "--tokens-per-rank", "4096"],
            "tokens_per_rank 4,096 must be a whole number of micro-batches",
        ),
        (
            ["plan", "--preset", "llama3-8b", "--world-size", "8192", "--block-rows", "32"],
            "group 'embed' has 4,008 blocks in all (largest: 'model.embed_tokens.weight', "
            "131,072 elements), fewer than W=8192 ranks",
        ),
    ],
)
def test_bad_input_is_one_line_and_nonzero(argv, message) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shard_planner._cli", *argv], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_compare_takes_a_group_file(tmp_path, capsys) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"tensors": [{"name": "w", "shape": [1009, 64]}]}))
    assert main(["compare", str(path), "--world-sizes", "4,8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.split() and line.split()[0].isdigit()]) == 2


def test_plan_says_when_it_pads_more_than_fsdp2_and_why(tmp_path, capsys) -> None:
    path = tmp_path / "g.json"
    tensors = [{"name": "a", "shape": [1009, 777]}, {"name": "b", "shape": [513, 1009]}]
    path.write_text(json.dumps({"tensors": tensors}))
    argv = ["plan", str(path), "--world-size", "8", "--block-rows", "1009"]
    assert main([*argv, "--allow-idle-ranks"]) == 0  # 2 blocks for 8 ranks
    out = capsys.readouterr().out
    assert "more than FSDP2's 12,502" in out, out
    assert "the largest block (a, 783,993 elements) must sit on one rank" in out, out
    # One row per block: a holds a whole shard (S a multiple of 777); any smaller S would put
    # one inside b too, and lcm(777, 1009) is all of a.
    assert main(["plan", str(path), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "padding=774,534 (59.506%)" in out, out
    assert "1 tensor(s) (a) hold a whole shard" in out, out
    assert "a smaller S would put a whole shard inside b too" in out, out
    assert "multiple of 783,993" in out, out
    single = tmp_path / "one.json"
    single.write_text(json.dumps({"tensors": [{"name": "w", "shape": [1009, 64]}]}))
    assert main(["plan", str(single), "--world-size", "4"]) == 0
    assert "note:" not in capsys.readouterr().out  # no worse than FSDP2


def test_bad_json_file_is_one_line(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"tensors": [{"name": "a", "numel": -5}]}')
    result = subprocess.run(
        [sys.executable, "-m", "shard_planner._cli", "plan", str(path), "--world-size", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"shard-planner: error: {path}, group 'group', tensor 'a': "
        "TensorSpec('a').numel must be >= 0, got -5"
    )


def test_plot_needs_matplotlib_or_draws(tmp_path, capsys) -> None:
    out = tmp_path / "p.png"
    code = main(["compare", "--preset", "llama3-8b", "--world-sizes", "8", "--plot", str(out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "pip install 'shard-planner[plot]'" in capsys.readouterr().err
    else:
        assert code == 0 and out.stat().st_size > 1000


def test_estimate_prints_the_figures_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "e.json"
    argv = ["estimate", "--preset", "llama3-8b", "--shard-size", "8", "--replicate-size", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 replicas x 8 shards = 16" in text and "optimizer state per rank" in text
    record = json.loads(out.read_text())
    assert record["shard_size"] == 8 and record["all_reduce_bytes"] > 0


def test_advise_ranks_the_splits_and_names_the_padding(tmp_path, capsys) -> None:
    out = tmp_path / "a.json"
    argv = ["advise", "--preset", "gpt-oss-120b", "--ranks", "1024", "--memory-gb", "80"]
    assert main([*argv, "--block-rows", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    # 16 x 64 is 0.5% faster than 8 x 128 and 1% faster than 4 x 256 but leaves 7% free
    # against 23% and 31%: ties, on headroom; it ranks after every roomy split.
    assert "| 1 | 4 x 256 | blocks | 28.216 | 0.61% | 54.9 | 31% | yes |" in text
    assert "| 2 | 8 x 128 | blocks | 28.046 | 0.23% | 61.4 | 23% | yes |" in text
    assert "| 9 | 16 x 64 | blocks | 27.908 | 0.05% | 74.7 | 7% | yes |" in text
    # Fused experts wrapped apart: 16-row blocks of whole experts pad more, so they rank later.
    assert "| 4 | 16 x 64 | experts apart | 29.345 | 5.14% | 53.5 | 33% | yes |" in text
    padding = "padding under 3% at shard sizes [32, 64, 128, 256, 512]; at or above it at [1024]"
    assert padding in text
    rows = json.loads(out.read_text())
    # The splits that fit (W >= 64: below, the sharded state alone exceeds 80 GiB).
    assert len(rows) == 10 and all(r["replicate_size"] * r["shard_size"] == 1024 for r in rows)
    assert {r["expert_groups"] for r in rows} == {0, 1}


def test_advise_says_when_nothing_fits(capsys) -> None:
    argv = ["advise", "--preset", "deepseek-v3-671b-per-expert", "--ranks", "1024"]
    argv += ["--memory-gb", "80"]
    assert main([*argv, "--expert-groups", "0"]) == 0  # blocks whole: nothing fits
    out = capsys.readouterr().out
    assert "no split fits in 80.0 GiB per rank" in out
    # What each single change gives: bf16 gathers alone do not fit, expert groups do.
    assert "next lever: bf16 gathers (--compute-bytes 2): smallest peak 117.0 GiB" in out
    lever = "next lever: every expert granularity (no --expert-groups): smallest peak 30.9 GiB"
    assert f"{lever} (1 x 1024), fits" in out and "does not fit" in out
    # More ranks: a whole MoE layer gathered in fp32 (42.9 GiB), the next one prefetched, and
    # its unsharded gradients beside the previous layer's: no shard count holds them.
    more = "next lever: more ranks do not help: the gathered groups, unsharded gradients and"
    assert f"{more} activations alone take 171.8 GiB per rank at any shard size" in out


def test_advise_plot_needs_matplotlib_or_draws(tmp_path, capsys) -> None:
    out = tmp_path / "a.png"
    argv = ["advise", "--preset", "llama3-8b", "--ranks", "64", "--memory-gb", "80"]
    code = main([*argv, "--plot", str(out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "pip install 'shard-planner[plot]'" in capsys.readouterr().err
    else:
        assert code == 0 and out.stat().st_size > 1000
