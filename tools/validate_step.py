"""Predicted against measured FSDP step time, the planner calibrated on the machine it runs on.

For the example decoder (dense and MoE) at one rank and at each world size W, in one spawned
process group each:
1. links: all-gathers and reduce-scatters timed as `calibrate_links.py` times them;
2. compute: all W ranks run forward + backward of the whole model at once, with no FSDP and
   no communication; a rank's rate is the planner's FLOPs for its tokens over the median time
   (W ranks share this machine's cores, so the rate is measured at each W);
3. overlap: all-gathers alone, the compute alone, then both at once;
4. the update's bandwidth: AdamW on 1M fp32 elements;
5. measured: the engine trains the model wrapped as the plan prints it (`fully_shard_calls`
   of its groups), AdamW; the step is the slowest rank's, forward to optimizer step, median
   (interleaved with the compute runs, so that both see the same machine).
The host work per step is what one rank's step takes beyond its compute and update, scaled
at W by how much the compute slowed (on CPU, where the ranks share the cores). Then the links
are fitted over every W (`fit_links`) and `shard_planner.estimate` predicts the step
(`step_time_s`) with the fitted links and a `ComputeModel` at the measured rate (peak =
rate, MFU 1), overlap, update bandwidth and host work.

Usage:
    python tools/validate_step.py [--worlds 2,3,4] [--models dense,moe] [--steps 8]
        [--device cpu] [--out build/validate_step.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from calibrate_links import collectives, free_port, measure_collectives, parse_ints
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.spawn import spawn

from fsdp_engine import fully_shard
from shard_planner import ComputeModel, Links, estimate, fit_links, fully_shard_calls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from model import Config, Decoder, loss_fn
from planning import decoder_groups

# Big enough that a step is mostly matmuls on this CPU, small enough for 4 ranks on 2 cores.
MODELS = {
    "dense": Config(vocab=256, dim=256, num_heads=4, num_layers=4, hidden=688),
    "moe": Config(vocab=256, dim=256, num_heads=4, num_layers=4, hidden=688, num_experts=8),
}
SEQ_LEN, BATCH = 128, 4  # per rank: 512 tokens a step
LINK_SIZES_KIB = [64, 256, 1024, 4096]


def _slowest(times: list[float]) -> float:
    """The median over runs of the slowest rank's time (each run's maximum over ranks)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    worst = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(statistics.median(worst.tolist()))


def _clock(fn: Callable[[], object], device: torch.device) -> float:
    """One run of `fn` on every rank at once: its seconds on this rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _overlap(
    compute: Callable[[], None], compute_s: float, runs: int, device: torch.device
) -> float:
    """How much of the shorter of compute and collectives hides behind the other, 0..1.

    All-gathers of 4 MiB shards (about half the compute's time) run alone, then started
    asynchronously before the compute and waited after it: overlap = (compute + gathers -
    both) / min(compute, gathers).
    """
    shard = torch.ones(2**20, device=device)
    full = torch.empty(2**20 * dist.get_world_size(), device=device)

    gather = collectives()["all_gather"]

    def gathers(count: int) -> list[Any]:
        return [gather(full, shard, async_op=True) for _ in range(count)]

    one = _slowest([_clock(lambda: [w.wait() for w in gathers(1)], device) for _ in range(3)])
    count = max(1, round(compute_s / 2 / one))
    alone = _slowest(
        [_clock(lambda: [w.wait() for w in gathers(count)], device) for _ in range(runs)]
    )

    def both() -> None:
        works = gathers(count)
        compute()
        for work in works:
            work.wait()

    together = _slowest([_clock(both, device) for _ in range(runs)])
    hidden = (compute_s + alone - together) / min(compute_s, alone)
    return min(1.0, max(0.0, hidden))


def _update_gbps(runs: int, device: torch.device) -> float:
    """The bandwidth AdamW's update streams at: 28 bytes per fp32 element (read parameter,
    gradient and both moments; write parameter and moments), 4 tensors of 2^18 elements
    (a rank's share of a group here)."""
    params = [torch.nn.Parameter(torch.randn(2**18, device=device)) for _ in range(4)]
    for param in params:
        param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW(params, lr=1e-4)
    seconds = _slowest([_clock(opt.step, device) for _ in range(runs + 2)][2:])
    return 28 * 4 * 2**18 / seconds / 1e9


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result: dict[str, Any] = {"world": world, "links": [], "overlap": 1.0, "models": {}}
    if world > 1:
        result["links"] = measure_collectives(LINK_SIZES_KIB, args.repeats, device)
    gen = torch.Generator().manual_seed(rank)
    mesh = init_device_mesh(device.type, (world,))
    for index, name in enumerate(args.models):
        cfg = MODELS[name]
        tokens = torch.randint(0, cfg.vocab, (BATCH, SEQ_LEN), generator=gen).to(device)
        torch.manual_seed(0)
        plain = Decoder(cfg).to(device)
        model = Decoder(cfg).to(device)
        model.load_state_dict(plain.state_dict())
        code = "\n".join(fully_shard_calls(decoder_groups(model)))
        exec(code, {"model": model, "fully_shard": functools.partial(fully_shard, mesh=mesh)})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def compute(plain: Decoder = plain, tokens: torch.Tensor = tokens) -> None:
            loss_fn(plain(tokens), tokens).backward()  # type: ignore[no-untyped-call]
            plain.zero_grad(set_to_none=True)

        def train(model: Decoder = model, tokens: torch.Tensor = tokens, opt: Any = opt) -> None:
            loss_fn(model(tokens), tokens).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad(set_to_none=True)

        # Interleaved, so that both see the same machine (other jobs come and go).
        runs: dict[str, list[float]] = {"compute_s": [], "step_s": []}
        for attempt in range(args.steps + 2):  # two warm-up runs
            times = (_clock(compute, device), _clock(train, device))
            if attempt >= 2:
                for key, seconds in zip(runs, times, strict=True):
                    runs[key].append(seconds)
        got = {key: _slowest(values) for key, values in runs.items()}
        result["models"][name] = got
        if index == 0 and world > 1:
            result["overlap"] = _overlap(compute, got["compute_s"], args.steps, device)
    result["memory_gbps"] = _update_gbps(args.steps, device)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def predict(name: str, run: dict[str, Any], links: Links, host_s: float) -> dict[str, float]:
    """The planner's step for model `name` in `run`, calibrated by that run's measurements
    and the host work per step `host_s` (from one rank, scaled as the compute slowed)."""
    cfg, world = MODELS[name], run["world"]
    groups = decoder_groups(Decoder(cfg))
    top_k = cfg.top_k if cfg.num_experts else None
    tokens = SEQ_LEN * BATCH
    options = {"shard_size": world, "ranks_per_node": world, "allow_idle_ranks": True}
    counted = estimate(groups, **options, compute=ComputeModel(tokens, top_k, hidden_size=cfg.dim))
    flops = counted.flops_per_token * tokens  # what the planner counts: 6 per matmul weight
    rate = flops / run["models"][name]["compute_s"]
    compute = ComputeModel(
        tokens_per_rank=tokens,
        top_k=top_k,
        peak_tflops=rate / 1e12,
        mfu=1.0,
        hidden_size=cfg.dim,
        overlap=run["overlap"],
        memory_gbps=run["memory_gbps"],
        host_overhead_s=host_s,
    )
    est = estimate(groups, **options, compute=compute, **links.options())
    return {
        "predicted_s": est.step_time_s,
        "comm_s": est.comm_time_s,
        "update_s": est.optimizer_time_s,
        "host_s": host_s,
        "gflops_per_s": rate / 1e9,
    }


def _host_overhead(alone: dict[str, Any], name: str) -> float:
    """One rank's step beyond its compute and the update: the engine's host work."""
    got = alone["models"][name]
    update = predict(name, alone, Links(400.0, 50.0, 20.0, 2.0, 1), 0.0)["update_s"]
    return max(0.0, float(got["step_s"] - got["compute_s"] - update))


def _slowdown(run: dict[str, Any], alone: dict[str, Any], name: str, args: Any) -> float:
    if args.device != "cpu":
        return 1.0
    return float(run["models"][name]["compute_s"] / alone["models"][name]["compute_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=parse_ints, default=[2, 3, 4])
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="runs per collective timing")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", help="write the measurements and predictions as JSON")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    context = mp.get_context("spawn")
    runs = []
    for world in sorted({1, *args.worlds}):  # one rank first: the host work per step
        queue = context.SimpleQueue()
        spawn(_rank, args=(world, free_port(), args, queue), nprocs=world)
        runs.append(queue.get())
    alone = runs[0]
    host = {name: _host_overhead(alone, name) for name in args.models}
    runs = [run for run in runs if run["world"] in args.worlds]
    records = [r for run in runs for r in run["links"]]
    default = Links(400.0, 50.0, 20.0, 2.0, max(args.worlds))
    links = (
        fit_links(records, ranks_per_node=max(args.worlds), default=default) if records else default
    )
    print(
        f"links fitted over W={args.worlds}: {links.intra_node_gbps:.2f} GB/s per rank, "
        f"{links.latency_us:.0f} us per collective, {links.hop_latency_us:.0f} us per ring step"
    )
    print(
        "| model | W | compute (GFLOP/s) | overlap | comm | update | host | step predicted | "
        "step measured | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for run in runs:
        for name, got in run["models"].items():
            row = {
                "model": name,
                "world": run["world"],
                "overlap": run["overlap"],
                "memory_gbps": run["memory_gbps"],
                **got,
                # Host work runs on the cores the ranks share: it slows as their compute did
                # (on a GPU it does not).
                **predict(name, run, links, host[name] * _slowdown(run, alone, name, args)),
            }
            row["error"] = row["predicted_s"] / row["step_s"] - 1
            rows.append(row)
            print(
                f"| {name} | {row['world']} | {got['compute_s'] * 1e3:.0f} ms "
                f"({row['gflops_per_s']:.1f}) | {run['overlap']:.2f} | "
                f"{row['comm_s'] * 1e3:.0f} ms | {row['update_s'] * 1e3:.0f} ms | "
                f"{row['host_s'] * 1e3:.0f} ms | "
                f"{row['predicted_s'] * 1e3:.0f} ms | {got['step_s'] * 1e3:.0f} ms | "
                f"{row['error']:+.0%} |"
            )
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"links": links.options(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
