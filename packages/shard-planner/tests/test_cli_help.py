"""The command line as a newcomer meets it: help for every option, one note per shape, units."""

import argparse
import json

import pytest

from shard_planner import Layout, TensorSpec, _cli, plan_layout
from shard_planner._cli import main

SUBCOMMANDS = ("plan", "compare", "show", "estimate", "advise")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = _cli._parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_option_has_help_and_shows_its_default(command, capsys) -> None:
    sub = _subparsers()[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{command} {name} has no help text"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for action in sub._actions:
        default = action.default
        if action.option_strings and default not in (None, False, argparse.SUPPRESS):
            shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
            assert f"(default: {default})" in text or f"(default: {shown})" in text, (
                command,
                action.option_strings,
            )
    assert "(default: None)" not in text
    assert "shard_planner._" not in text, "help names a private module"


def test_plan_prints_one_note_per_group_shape(capsys) -> None:
    assert main(["plan", "--preset", "llama3-8b", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.lstrip().startswith("note")]
    # 32 identical decoder layers pad alike: one note, under the first, counting the rest;
    # the output head (its own shape) has its own.
    assert len(notes) == 2, notes
    assert notes[0].startswith("  note (and for the 31 other groups of this shape):")
    assert notes[1].startswith("  note: ") and "lm_head.weight" in notes[1]
    assert out.count("model.layers.") >= 32  # every group still has its summary line


def test_show_explains_its_notation(capsys) -> None:
    argv = ["show", "--preset", "llama3-8b", "--world-size", "4", "--group", "model.layers.0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "xNu = N whole units" in out and "x4096u" in out


def test_estimate_states_units_per_rank(capsys) -> None:
    assert main(["estimate", "--preset", "llama3-8b", "--shard-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "all-gather sent per rank per step" in out
    # Sizes in GiB everywhere; GB only in the links' rates (GB/s, as their flags take them).
    assert all(rest.startswith("/s") for rest in out.split(" GB")[1:]), "GiB everywhere"
    assert "400 GB/s per rank inside it" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--preset", "llama3-8b", "--plot", "{out}"],
        [
            "advise",
            "--preset",
            "llama3-8b",
            "--ranks",
            "64",
            "--memory-gb",
            "80",
            "--plot",
            "{out}",
        ],
        ["show", "--preset", "llama3-8b", "--out", "{out}"],
    ],
    ids=["compare", "advise", "show"],
)
def test_a_picture_without_matplotlib_is_refused_before_any_work(
    argv, tmp_path, monkeypatch, capsys
) -> None:
    real = _cli.importlib.util.find_spec
    monkeypatch.setattr(
        _cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )

    def no_work(*_: object) -> None:
        raise AssertionError("the model was loaded before the picture was checked")

    monkeypatch.setattr(_cli, "_load_model", no_work)
    argv = [part.replace("{out}", str(tmp_path / "p.png")) for part in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'shard-planner[plot]'" in err
    # A folder that does not exist is refused before the work too.
    monkeypatch.undo()
    monkeypatch.setattr(_cli, "_load_model", no_work)
    argv = [part.replace(str(tmp_path), str(tmp_path / "missing")) for part in argv]
    assert main(argv) == 2
    assert "does not exist" in capsys.readouterr().err


def _links_file(tmp_path, size: float) -> str:
    path = tmp_path / "links.json"
    record = {"collective": "all_gather", "world": 2, "bytes": size, "seconds": 0.1}
    measurements = [{**record, "inter_node": False}]
    path.write_text(
        json.dumps({"backend": "gloo", "ranks_per_node": 8, "measurements": measurements})
    )
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["advise", "--preset", "llama3-8b", "--ranks", "64", "--memory-gb", "1e300"],
         "--memory-gb: must be at most 1,048,576 GiB per rank, got '1e300'"),
        (["advise", "--preset", "llama3-8b", "--ranks", "64", "--memory-gb", "80",
          "--activation-gb", "1e300"], "--activation-gb: must be at most 1,048,576 GiB"),
        (["estimate", "--preset", "llama3-8b", "--shard-size", "8", "--links", "{links}"],
         "measurement 0: bytes must be a number in (0, 2**62), got inf"),
        (["show", "--layout", "{empty}"], "holds no groups: write one with `plan --out`"),
        (["advise", "--preset", "deepseek-v3-671b", "--ranks", "1024", "--memory-gb", "80",
          "--expert-parallel", "3", "--tokens-per-rank", "4096", "--top-k", "8"],
         "expert_parallel 3 must divide the 256 experts of each MoE block and the 1024 "
         "ranks; valid: 1, 2, 4, 8, 16, 32, 64, 128, 256"),
        (["advise", "--preset", "llama3-8b", "--ranks", "1000000000", "--memory-gb", "80"],
         "--ranks: must be at most 1,048,576 ranks, got '1000000000'"),
        (["plan", "--preset", "llama3-8b", "--world-size", "1000000000000"],
         "--world-size: must be at most 1,048,576 ranks"),
        (["show", "--layout", "{huge}"], "world_size must be at most 1,048,576 ranks"),
    ],
    ids=["memory", "activations", "links-inf", "empty-plan", "ep-3", "ranks-1e9", "world-1e12",
         "plan-file-1e12"],
)  # fmt: skip
def test_bad_numbers_are_one_line_errors_before_any_work(argv, message, tmp_path, capsys) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text('{"groups": {}}')
    huge = tmp_path / "huge.json"
    layout = Layout.from_json(plan_layout([TensorSpec("w", 8)], 2).to_json())
    record = json.loads(layout.to_json())
    record["world_size"] = 10**12
    huge.write_text(json.dumps({"groups": {"g": record}}))
    subs = {"{links}": _links_file(tmp_path, float("inf")), "{empty}": str(empty),
            "{huge}": str(huge)}  # fmt: skip
    argv = [subs.get(part, part) for part in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own one-line errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_printed_calls_reach_modules_whose_names_are_not_attributes() -> None:
    from shard_planner import GroupSpec, fully_shard_calls

    groups = [
        GroupSpec.from_shapes("layers.0", {"layers.0.w": (8, 8)}),
        GroupSpec.from_shapes("norm-1", {"norm-1.weight": (8,)}),
    ]
    lines = fully_shard_calls(groups)
    # `model.norm-1` would be a subtraction; get_submodule takes any registered name.
    assert "fully_shard(model.get_submodule('norm-1'))" in lines, lines
    assert not any("model.norm-1" in line for line in lines), lines


def test_no_fit_answers_with_the_table_and_what_fits(capsys) -> None:
    # At 8192 ranks the embedding's 4,008 blocks refuse W >= 8192; smaller shard sizes are
    # estimated, so the answer is the no-fit table and its levers, not that refusal.
    argv = ["advise", "--preset", "llama3-8b", "--ranks", "8192", "--memory-gb", "0.5"]
    assert main([*argv, "--block-rows", "32"]) == 0
    out = capsys.readouterr().out
    assert "no split fits in 0.5 GiB per rank" in out and "fewer than W=" not in out
    rows = [line for line in out.splitlines() if line.startswith("| - |")]
    assert len(rows) == 10 and "more rows (--all prints every row)" in out
    assert "next lever: one-row blocks (--block-rows 1)" in out
    assert main([*argv, "--block-rows", "32", "--all"]) == 0
    assert len([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| - |")]) > 10


def test_no_fit_names_the_rank_count_that_fits(capsys) -> None:
    assert main(["advise", "--preset", "llama3-70b", "--ranks", "8", "--memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    # 70.6B parameters with fp32 AdamW: 16 bytes each, 1.13 TB of state; 16 ranks hold it.
    assert "next lever: more ranks: 16 fit (1 x 16, 78.8 GiB per rank)" in out, out[-1500:]
    assert main(["advise", "--preset", "llama3-70b", "--ranks", "16", "--memory-gb", "80"]) == 0
    assert "| 1 | 1 x 16 |" in capsys.readouterr().out  # and it does
