"""Step times of both engines measured alternately in one run (`train.py --alternate N`).

One run of `train.py` per engine gives step times that whatever else loads the machine at
the time skews (one such pair gave ours 0.49x FSDP2's; alternated, 0.67-0.74x). Here every
setup is built once, on the same ranks, model, data and seed, and each round runs a few steps
of every setup in turn, the order rotating each round, so that a slow spell falls on all of
them. Reported: each setup's median step over the rounds and the spread of its round medians,
and per round the ratio of each setup to FSDP2, with its spread.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_engine import clip_grad_norm_

# (engine, optimizer): ours with its own AdamW and with torch's (the same optimizer as
# FSDP2's, so the engines alone are compared), and FSDP2 with torch's.
SETUPS = (("ours", "flat-adamw"), ("ours", "adamw"), ("fsdp2", "adamw"))
STEPS_PER_ROUND = 4
WARMUP_ROUNDS = 1  # first-step allocations and lazy initialization, left out


def label(engine: str, optimizer: str) -> str:
    """How a setup is named in the tables."""
    engines = {"ours": "ours", "fsdp2": "FSDP2"}
    optimizers = {"flat-adamw": "ragged_optimizers.AdamW", "adamw": "torch.optim.AdamW"}
    return f"{engines[engine]} + {optimizers[optimizer]}"


def time_setups(
    args: argparse.Namespace,
    build: Callable[[argparse.Namespace], tuple[nn.Module, torch.optim.Optimizer, Any]],
    batch: Callable[[int], torch.Tensor],
    device: torch.device,
) -> dict[str, Any]:
    """Times `args.alternate` rounds of every setup; the record is the same on every rank.

    Args:
        args: train.py's arguments (the model and batch options apply to every setup).
        build: Builds (model, optimizer, runner) for a copy of `args` with the setup's engine
            and optimizer.
        batch: This rank's tokens for a step.
        device: This rank's device.
    """
    built = []
    for engine, optimizer in SETUPS:
        setup_args = copy.copy(args)
        setup_args.engine, setup_args.optimizer = engine, optimizer
        built.append(build(setup_args))
    rounds: list[list[float]] = [[] for _ in SETUPS]
    step = 0
    for round_index in range(WARMUP_ROUNDS + args.alternate):
        shift = round_index % len(SETUPS)
        for index in [*range(shift, len(SETUPS)), *range(shift)]:
            model, opt, runner = built[index]
            times = []
            for _ in range(STEPS_PER_ROUND):
                times.append(_timed_step(model, opt, runner, batch(step), device))
                step += 1
            if round_index >= WARMUP_ROUNDS:
                rounds[index].append(statistics.median(times))
        if dist.get_rank() == 0 and round_index >= WARMUP_ROUNDS:
            cells = ", ".join(
                f"{label(*setup)} {r[-1] * 1e3:.0f} ms"
                for setup, r in zip(SETUPS, rounds, strict=True)
            )
            print(f"round {round_index + 1 - WARMUP_ROUNDS}/{args.alternate}: {cells}", flush=True)
    return _record(rounds, dist.get_world_size())


def _timed_step(
    model: nn.Module, opt: torch.optim.Optimizer, runner: Any, tokens: torch.Tensor,
    device: torch.device,
) -> float:  # fmt: skip
    dist.barrier()  # every rank starts the step together
    start = time.perf_counter()
    runner.loss_and_backward(tokens)
    clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    elapsed = torch.tensor(time.perf_counter() - start, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(elapsed.item())


def _record(rounds: list[list[float]], world: int) -> dict[str, Any]:
    baseline = rounds[[engine for engine, _ in SETUPS].index("fsdp2")]
    setups = []
    for (engine, optimizer), times in zip(SETUPS, rounds, strict=True):
        ratios = [t / b for t, b in zip(times, baseline, strict=True)]
        setups.append(
            {
                "engine": engine,
                "optimizer": optimizer,
                "label": label(engine, optimizer),
                "round_s": times,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "ratio_to_fsdp2": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        )
    return {
        "world": world,
        "rounds": len(baseline),
        "steps_per_round": STEPS_PER_ROUND,
        "setups": setups,
    }


def timing_table(record: dict[str, Any]) -> str:
    """A markdown table of a `time_setups` record."""
    lines = [
        f"Step times, {record['rounds']} rounds of {record['steps_per_round']} steps per setup, "
        f"alternated in one run (W={record['world']}; median of the round medians, and their "
        f"range):",
        "| setup | step (ms) | range over rounds (ms) | step / FSDP2's (range) |",
        "| --- | --- | --- | --- |",
    ]
    for s in record["setups"]:
        lines.append(
            f"| {s['label']} | {s['median_s'] * 1e3:.1f} | {s['min_s'] * 1e3:.1f}-"
            f"{s['max_s'] * 1e3:.1f} | {s['ratio_to_fsdp2']:.2f} ({s['ratio_min']:.2f}-"
            f"{s['ratio_max']:.2f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit("run it through train.py: python examples/train.py --nproc 2 --alternate 8")
