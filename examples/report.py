"""Side-by-side table and loss curves of `train.py` runs (one JSON per engine).

python examples/report.py build/demo/ours.json build/demo/fsdp2.json --plot build/demo/loss.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("final train loss", lambda r: f"{r['train'][-1][1]:.4f}"),
    ("final validation loss", lambda r: f"{r['val'][-1][1]:.4f}"),
    ("unigram entropy (nats/char)", lambda r: f"{r['unigram_entropy']:.4f}"),
    ("median step (ms)", lambda r: f"{r['median_step_s'] * 1e3:.1f}"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("peak live tensors, one step (MB)", lambda r: f"{r['peak_live_bytes'] / 1e6:.2f}"),
    ("copy kernels in the engine, one step", lambda r: str(_copies(r)[0])),
    ("bytes they copy, one step (MB)", lambda r: f"{_copies(r)[1] / 1e6:.2f}"),
    ("padding in the shards (bytes)", lambda r: f"{r['padding_bytes']:,}"),
    ("all-gathered into one rank, one step (MB)", lambda r: _gathered(r)),
)


def _gathered(record: dict[str, Any]) -> str:
    count = record.get("gathered_bytes")
    return "-" if count is None else f"{count / 1e6:.3f}"


def _copies(record: dict[str, Any]) -> tuple[int, int]:
    copies = record.get("copies", {})
    return sum(c["kernels"] for c in copies.values()), sum(c["bytes"] for c in copies.values())


def name(record: dict[str, Any]) -> str:
    """The run's engine, and its gather format when not the parameters' own."""
    return str(record["engine"]) + (", fp8 gathers" if record.get("gather") == "fp8" else "")


def table(records: list[dict[str, Any]]) -> str:
    """A markdown table: one column per run."""
    names = [f"{name(r)} (W={r['world']})" for r in records]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(records)]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in records) + " |")
    return "\n".join(lines)


def agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How long two runs' training losses stay bit-identical, and how far apart they end."""
    first, second = dict(a["train"]), dict(b["train"])
    steps = sorted(set(first) & set(second))
    same = next((s for s in steps if first[s] != second[s]), None)
    biggest = max(abs(first[s] - second[s]) for s in steps)
    until = f"identical up to step {same - 1}" if same else "identical at every step"
    return (
        f"training losses of {name(a)} and {name(b)}: {until}; largest difference "
        f"{biggest:.2e} (floating-point summation order, amplified by training)"
    )


def plot(records: list[dict[str, Any]], path: pathlib.Path) -> None:
    """Training and validation loss against the step, one colour per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for record, colour in zip(records, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        steps, losses = zip(*record["train"], strict=True)
        ax.plot(steps, losses, color=colour, alpha=0.5, lw=1, label=f"{name(record)} train")
        steps, losses = zip(*record["val"], strict=True)
        ax.plot(steps, losses, "o-", color=colour, label=f"{name(record)} validation")
    entropy = records[0]["unigram_entropy"]
    ax.axhline(entropy, color="grey", ls="--", lw=1, label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/char)")
    ax.set_title("Shakespeare, character level")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Prints the table of the given runs and draws their loss curves."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="JSON files of train.py")
    parser.add_argument("--plot", type=pathlib.Path, help="write the loss curves here (PNG)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.runs if not p.is_file()]
    if missing:
        print(f"report.py: error: no such run file: {', '.join(missing)}", file=sys.stderr)
        return 2
    records = [json.loads(p.read_text()) for p in args.runs]
    print(table(records))
    if len(records) >= 2:
        print(agreement(records[0], records[1]))
    if args.plot is not None:
        plot(records, args.plot)
        print(f"loss curves: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
