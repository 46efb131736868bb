"""Side-by-side table and loss curves of `train.py` runs (one JSON per engine).

python examples/report.py build/demo/ours.json build/demo/fsdp2.json --plot build/demo/loss.png

With `--timing build/demo/timing.json` (`train.py --alternate N`) it also prints the step
times of both engines measured alternately in one run: one run per engine times each under
whatever else loaded the machine then, so the table of runs leaves step times out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import alternate

ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("final train loss", lambda r: f"{r['train'][-1][1]:.4f}"),
    ("final validation loss", lambda r: f"{r['val'][-1][1]:.4f}"),
    ("unigram entropy (nats/char)", lambda r: f"{r['unigram_entropy']:.4f}"),
    ("peak live tensors, one step (MB)", lambda r: f"{r['peak_live_bytes'] / 1e6:.2f}"),
    ("copy kernels in the engine, one step", lambda r: str(_copies(r)[0])),
    ("bytes they copy, one step (MB)", lambda r: f"{_copies(r)[1] / 1e6:.2f}"),
    ("padding in the shards (bytes)", lambda r: f"{r['padding_bytes']:,}"),
    ("all-gathered into one rank, one step (MB)", lambda r: _gathered(r)),
)


_CHUNK_CAT = "FSDP2: the gradients into the reduce-scatter input, one kernel per group"
# What each copy kernel the profiler finds inside an engine's ranges is, by op and stage.
COPIES_EXPLAINED = {
    "aten::copy_ in FSDP::unshard": "gloo only: the rank's shard into its own chunk of the "
    "gathered buffer, which gloo then broadcasts in place (NCCL's all-gather reads the shard "
    "itself); the parameters are views of that buffer: no copy-out",
    "aten::copy_ in FSDP::post_backward": "each gradient autograd wrote into a tensor of its "
    "own, into the group's reduce-scatter buffer: one kernel per gradient (FSDP2's chunk_cat "
    "does it with one per group), the same bytes",
    "aten::copy_ in FSDP::wait_for_reduce": "gloo only: the reduced shard, out of the buffer "
    "gloo all-reduced in place, into the sharded gradient (NCCL reduce-scatters straight "
    "into it)",
    "aten::_to_copy in FSDP::unshard": "fp8 quantization: the 0-d scalars torch makes while "
    "computing the block scales (bytes each)",
    "aten::_to_copy in FSDP::wait_for_unshard": "fp8: the gathered codes widened to the "
    "compute dtype (dequantization's first pass)",
    "aten::copy_ in FSDP::wait_for_unshard": "fp8: the scaled values into each parameter's "
    "place in the gathered buffer (dequantization's second pass)",
    "fsdp::all_gather_copy_in in FSDP::all_gather": "FSDP2's copy-in: every parameter's "
    "shard into one all-gather input",
    "fsdp::split_with_sizes_copy in FSDP::all_gather_copy_out": "FSDP2's copy-out: the "
    "gathered buffer out into each parameter (W x the shard's bytes)",
    "fsdp::chunk_cat in FSDP::post_backward_reduce": _CHUNK_CAT,
    # torch 2.15 renamed the op (it also casts gradients of another dtype on the way).
    "fsdp::chunk_cat_mixed_dtype in FSDP::post_backward_reduce": _CHUNK_CAT,
    "aten::copy_ in FSDP::post_backward_reduce": "FSDP2 on gloo: the reduced shard into the "
    "sharded gradient",
}


def copies_table(records: list[dict[str, Any]]) -> str:
    """Each run's copy kernels in one step, by op and stage, with what each one is."""
    lines = [
        "Copy kernels inside the engine in one step (profiler, training thread):",
        "| run | op, in stage | kernels | MB | what it is |",
        "| --- | --- | --- | --- | --- |",
    ]
    for record in records:
        for key, count in record.get("copies", {}).items():
            what = COPIES_EXPLAINED.get(key, "(not explained here)")
            # fp8: the quantization of the shard into codes is an unshard copy too.
            if record.get("gather") == "fp8" and key == "aten::copy_ in FSDP::unshard":
                what = (
                    "fp8 quantization: each block's scale and codes (clamped x / scale) into "
                    "the send buffer; the 1-D parameters' shards into their chunk as without fp8"
                )
            lines.append(
                f"| {name(record)} | {key} | {count['kernels']} | {count['bytes'] / 1e6:.2f} "
                f"| {what} |"
            )
    return "\n".join(lines)


def _gathered(record: dict[str, Any]) -> str:
    count = record.get("gathered_bytes")
    return "-" if count is None else f"{count / 1e6:.3f}"


def _copies(record: dict[str, Any]) -> tuple[int, int]:
    copies = record.get("copies", {})
    return sum(c["kernels"] for c in copies.values()), sum(c["bytes"] for c in copies.values())


OPTIMIZERS = {
    "flat-adamw": "ragged_optimizers.AdamW",
    "adamw": "torch.optim.AdamW",
    "muon": "ragged_optimizers.Muon",
    "adamw8bit": "ragged_optimizers.AdamW8bit",
}


def name(record: dict[str, Any]) -> str:
    """The run's engine and optimizer, and its gather format when not the parameters' own."""
    engine = {"ours": "ours", "fsdp2": "FSDP2"}.get(record["engine"], record["engine"])
    optimizer = OPTIMIZERS.get(record.get("optimizer", ""), record.get("optimizer", "?"))
    fp8 = ", fp8 gathers" if record.get("gather") == "fp8" else ""
    return f"{engine} + {optimizer}{fp8}"


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
    parser.add_argument(
        "--timing", type=pathlib.Path, help="timing.json of train.py --alternate N, printed too"
    )
    args = parser.parse_args(argv)
    given = [*args.runs, *([args.timing] if args.timing else [])]
    missing = [str(p) for p in given if not p.is_file()]
    if missing:
        print(f"report.py: error: no such run file: {', '.join(missing)}", file=sys.stderr)
        return 2
    records = [json.loads(p.read_text()) for p in args.runs]
    print(table(records))
    if len(records) >= 2:
        print(agreement(records[0], records[1]))
    print()
    print(copies_table(records))
    if args.timing is not None:
        print()
        print(alternate.timing_table(json.loads(args.timing.read_text())))
    if args.plot is not None:
        plot(records, args.plot)
        print(f"loss curves: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
