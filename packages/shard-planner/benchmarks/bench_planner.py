"""Planner benchmark: planning time and layout quality on real presets and synthetic groups.

Run: `nox -s bench -- planner` (or `python benchmarks/bench_planner.py [--quick]`).

Prints:
1. Speed: one group of up to 1,000 tensors at W=10240 (the largest real group, DeepSeek-V3's
   MoE layer with 782 tensors, and synthetic 1,000-tensor groups with mixed blocks), and a
   whole DeepSeek-V3-671B preset at W=1024, every group planned (no caching). Targets: < 0.3 s
   per group and < 2 s per preset, in pure Python.
2. `advise` over its whole search (mesh splits, expert groupings, EP degrees, activation
   checkpointing, reshard_after_forward, prefetch, dense blocks on a node, fp32 and bf16
   reduction, with a compute model):
   DeepSeek-V3-671B at 1024 ranks (< 3 s) and the 2.4T synthetic MoE at 10240 ranks (< 10 s),
   the preset loaded each time.
3. Quality on every preset for W in {8 ... 10240} and block_rows in {1, 16, 32}: worst
   S / lower_bound over the groups, our padding, the lower bound's padding, FSDP2's padding.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import statistics
import time

from shard_planner import (
    ActivationModel,
    ComputeModel,
    TensorSpec,
    advise,
    load_preset,
    plan_layout,
    preset_names,
)
from shard_planner._cli import main as cli_main
from shard_planner._report import compare_case, format_table

WORLD_SIZES = (8, 64, 256, 1024, 3072, 8192, 10240)
BLOCK_ROWS = (1, 16, 32)


def _timed(fn, repeats: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(times)


def _synthetic_group(seed: int, num_tensors: int = 1000) -> list[TensorSpec]:
    rng = random.Random(seed)
    specs = []
    for i in range(num_tensors):
        # Mixed, mostly coprime row lengths: many lcm grids, few early exits at the bound.
        rows, cols = rng.randint(1, 5000), rng.randint(1, 5000)
        specs.append(
            TensorSpec.from_shape(f"t{i}", (rows, cols), block_rows=rng.choice([1, 16, 32]))
        )
    return specs


def speed(repeats: int) -> None:
    print("== speed (seconds; median and max of repeats) ==")
    moe = load_preset("deepseek-v3-671b-per-expert").groups[10]
    for rows in BLOCK_ROWS:
        specs = moe.specs(rows)
        med, worst = _timed(lambda specs=specs: plan_layout(specs, 10240), repeats)
        print(
            f"deepseek-v3 MoE layer ({len(specs)} tensors), W=10240, rows={rows:>3}: "
            f"median {med:.4f}  max {worst:.4f}  (target < 0.3)"
        )
    for world, align in ((10240, 1), (10240, 64), (1024, 8), (64, 1)):
        meds, worsts = [], []
        for seed in range(5):
            specs = _synthetic_group(seed)
            med, worst = _timed(
                lambda specs=specs, world=world, align=align: plan_layout(
                    specs, world, align=align
                ),
                repeats,
            )
            meds.append(med)
            worsts.append(worst)
        print(
            f"synthetic 1000 tensors x 5 seeds, W={world:>5}, align={align:>2}: "
            f"median {statistics.median(meds):.4f}  max {max(worsts):.4f}  (target < 0.3)"
        )
    preset = load_preset("deepseek-v3-671b-per-expert")
    for rows in BLOCK_ROWS:
        med, worst = _timed(
            lambda rows=rows: [plan_layout(g.specs(rows), 1024) for g in preset.groups], repeats
        )
        print(
            f"deepseek-v3-671b-per-expert whole preset ({len(preset.groups)} groups), "
            f"W=1024, rows={rows:>3}: "
            f"median {med:.3f}  max {worst:.3f}  (target < 2)"
        )


def advise_speed(repeats: int) -> None:
    """`advise` over every (replicate, shard) split, presets loaded fresh each time."""
    print("\n== advise (every split of the ranks; seconds, median and max) ==")
    # The whole search: splits, expert groupings, EP degrees (priced with 16K tokens per rank,
    # top-8 routing, DeepSeek-V3's width), with and without activation checkpointing (4096
    # tokens per sequence, 4 per micro-batch), both reshard_after_forward settings (the
    # second only where the model fits gathered) and fp32 / bf16 gradient reduction.
    compute = ComputeModel(tokens_per_rank=16384, top_k=8, hidden_size=7168)
    activations = ActivationModel(seq_len=4096, micro_batch=4, top_k=8)
    for name, ranks, target in (
        ("deepseek-v3-671b-per-expert", 1024, 3),
        ("synthetic-moe-2.4t", 10240, 10),
    ):
        med, worst = _timed(
            lambda name=name, ranks=ranks: advise(
                load_preset(name).groups,
                num_ranks=ranks,
                ranks_per_node=8,
                memory_bytes=80 * 2**30,
                compute_bytes=2,
                compute=compute,
                activations=activations,
                reduce_bytes=(4, 2),
            ),
            repeats,
        )
        print(f"{name} at {ranks} ranks: median {med:.2f}  max {worst:.2f}  (target < {target})")
    # Nothing fits in 20 GiB: the command line's whole answer (the table of every split, each
    # lever's search and the more-ranks check), EP priced as above.
    argv = ["advise", "--preset", "synthetic-moe-2.4t", "--ranks", "10240", "--memory-gb", "20",
            "--compute-bytes", "2", "--tokens-per-rank", "16384", "--top-k", "8"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as out:
        med, worst = _timed(lambda: cli_main(argv), repeats)
    assert "no split fits" in out.getvalue()
    print(f"synthetic-moe-2.4t at 10240 ranks, nothing fits (CLI): median {med:.2f}  "
          f"max {worst:.2f}  (target < 10)")  # fmt: skip


def quality(world_sizes: tuple[int, ...]) -> None:
    print("\n== quality: padding in % of the model; S/bound is the worst group ==")
    for name in preset_names():
        preset = load_preset(name)
        cases = [compare_case(preset, w, rows) for rows in BLOCK_ROWS for w in world_sizes]
        print(format_table(preset, cases))
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and world sizes")
    args = parser.parse_args()
    speed(repeats=2 if args.quick else 5)
    advise_speed(repeats=1 if args.quick else 3)
    quality((8, 1024, 10240) if args.quick else WORLD_SIZES)


if __name__ == "__main__":
    main()
