"""Training step of fsdp_engine against torch FSDP2, side by side (`nox -s bench -- engine`).

For each case (model x world size x dtype) both engines train the same model on the same data
in one process group, alternating step by step. Per case it prints the slowest rank's median
step (forward + backward + optimizer: `ragged_optimizers.AdamW` for ours, torch's
`AdamW(foreach=True)` for FSDP2, the same arithmetic) and the ratio ours / FSDP2, the peak
bytes of live tensors in one step (what was live at its start plus the profiler's memory
events, both sides alike), the copy kernels each engine
runs in one step and their bytes, the bytes all-gathered and reduce-scattered per step
(`CommCounter`), and the padding. Results go to build/bench/engine.json and engine.png.
dtype "fp8": both compute in bf16; ours all-gathers its matrices as fp8 codes with one scale
per 32 x 128 block (`gather_format=BlockFloat8`), FSDP2 gathers bf16.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, cast

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from model import Config, Decoder, loss_fn  # noqa: E402
from profiling import engine_copies, peak_live_bytes, step_breakdown  # noqa: E402

MODELS = {
    # 58.5M parameters: 8 blocks of dim 512 (25.7M), embedding and head of vocab 32000.
    "dense": Config(vocab=32000, dim=512, num_heads=8, num_layers=8, hidden=1408),
    # 64 small experts per block, each its own nn.Linears (as many MoE codebases have them).
    "moe": Config(vocab=32000, dim=384, num_heads=6, num_layers=4, hidden=512, num_experts=64),
}


def _build(
    name: str, engine: str, dtype: str, mesh: Any, *, backward_prefetch: bool = True
) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Decoder(MODELS[name])
    mp_policy = MixedPrecisionPolicy()
    if dtype in ("bf16", "fp8"):
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_engine

    fully_shard: Callable[..., Any] = (
        fsdp_engine.fully_shard if engine == "ours" else torch_fsdp.fully_shard
    )
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy}
    if dtype == "fp8" and engine == "ours":  # FSDP2 gathers bf16 (its fp8 needs torchao)
        from dbuffer import BlockFloat8

        kwargs["gather_format"] = BlockFloat8(block=(32, 128))
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if engine == "ours" and not backward_prefetch:  # a diagnostic: --no-backward-prefetch
        for module in (*model.layers, model):
            cast(Any, module).set_modules_to_backward_prefetch([])
    if engine == "fsdp2" and MODELS[name].num_experts:
        # Ranks route tokens to different experts; without this FSDP2's reduce-scatters
        # differ in size across ranks ("collective mismatch"). Ours needs no setting.
        model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    if engine == "ours":  # torch's AdamW arithmetic, one tensor per run of adjacent shards
        from ragged_optimizers import AdamW

        return model, AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _padding_bytes(model: torch.nn.Module, engine: str, world: int) -> int:
    if engine == "ours":
        from fsdp_engine import sharding_summary

        return sum(g.padding_bytes for g in sharding_summary(model))
    total = 0
    for p in model.parameters():
        rows = p.shape[0]
        total += (-rows % world) * (p.numel() // rows) * p.element_size()
    return total


def _cpu_floor(name: str, dtype: str, groups: list[Any], batch: int, seq: int) -> dict[str, float]:
    """A lower bound on the step time of ANY engine that trains this model with gloo's
    all-gather and reduce-scatter (as FSDP2 and ours do), on the cores of this machine.

    Each rank needs the CPU time of the forward and backward alone (the unsharded model in the
    compute dtype, nothing else) plus the CPU time that gloo spends, on all its threads, for
    the step's collectives alone: per group an all-gather for forward, one more for backward
    when it is resharded after forward (not the root), and a reduce-scatter in fp32 (sizes
    from `groups`, our engine's sharding summary). The optimizer and all copies are left out,
    so the bound is low. CPU seconds cannot exceed cores x wall time: step >= sum over ranks /
    cores, and >= the slowest rank's compute (one thread).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    cores = len(os.sched_getaffinity(0))
    compute_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    plain = Decoder(MODELS[name]).to(compute_dtype)
    gen = torch.Generator().manual_seed(100 + rank)

    def forward_backward() -> None:
        tokens = torch.randint(0, MODELS[name].vocab, (batch, seq), generator=gen)
        loss_fn(plain(tokens), tokens).backward()  # type: ignore[no-untyped-call]
        plain.zero_grad(set_to_none=True)

    tensors = []  # `groups`: ours' sharding_summary, the root group first (module order)
    for index, group in enumerate(groups):
        shard = torch.zeros(group.shard_numel, dtype=compute_dtype)
        full = torch.empty(group.shard_numel * world, dtype=compute_dtype)
        grad = torch.ones(group.shard_numel * world, dtype=torch.float32)
        out = torch.empty(group.shard_numel, dtype=torch.float32)
        tensors.append((1 if index == 0 else 2, shard, full, grad, out))

    def collectives() -> None:
        for gathers, shard, full, grad, out in tensors:
            for _ in range(gathers):
                dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(out, grad)

    def cpu_seconds(fn: Any) -> float:
        samples = []
        for _ in range(4):
            dist.barrier()  # every rank runs it at once, as in a step
            start = time.process_time()  # this process: every thread, gloo's included
            fn()
            samples.append(time.process_time() - start)
        return statistics.median(samples[1:])

    compute, comm = cpu_seconds(forward_backward), cpu_seconds(collectives)
    totals = torch.tensor([compute + comm, compute])
    dist.all_reduce(totals[:1], op=dist.ReduceOp.SUM)
    dist.all_reduce(totals[1:], op=dist.ReduceOp.MAX)
    floor = max(totals[0].item() / cores, totals[1].item())
    return {"compute_cpu_s": compute, "comm_cpu_s": comm, "cores": cores, "floor_s": floor}


def _case(
    name: str, dtype: str, steps: int, batch: int, seq: int, backward_prefetch: bool = True
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement import CommCounter

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    engines = {
        e: _build(name, e, dtype, mesh, backward_prefetch=backward_prefetch)
        for e in ("ours", "fsdp2")
    }
    from fsdp_engine import sharding_summary

    groups = sharding_summary(engines["ours"][0])
    vocab = MODELS[name].vocab
    gen = torch.Generator().manual_seed(rank)

    def step(engine: str) -> None:
        model, opt = engines[engine]
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        loss_fn(model(tokens), tokens).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()

    times: dict[str, list[float]] = {e: [] for e in engines}
    for index in range(steps + 2):  # two warm-up steps
        for engine in engines:
            dist.barrier()
            t0 = time.perf_counter()
            step(engine)
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
            if index >= 2:
                times[engine].append(elapsed.item())
    result: dict[str, Any] = {"model": name, "dtype": dtype, "world": world}
    for engine in engines:
        model = engines[engine][0]
        with CommCounter() as counter:
            step(engine)
        copies = engine_copies(functools.partial(step, engine))
        parts = step_breakdown(functools.partial(step, engine))
        result[engine] = {
            "median_step_s": statistics.median(times[engine]),
            "copy_kernels": sum(c.kernels for c in copies.values()),
            "copy_bytes": sum(c.bytes for c in copies.values()),
            "wire_bytes_received": counter.bytes_received,
            "padding_bytes": _padding_bytes(model, engine, world),
            "num_params": sum(p.numel() for p in model.parameters()),
            "breakdown_s": {
                "total": parts.total,
                "compute": parts.compute,
                "comm": parts.comm,
                "copies": parts.copies,
                "alloc": parts.alloc,
            },
        }
    # Peak memory with only one engine's model, optimizer and buffers alive: the live bytes
    # at the start of the step count every tensor reachable, so the other engine must be
    # gone. FSDP2 goes first; then ours goes and FSDP2 is built again (two warm-up steps).
    del model, copies
    for engine in ("ours", "fsdp2"):
        for other in [e for e in engines if e != engine]:
            del engines[other]
        if engine not in engines:
            engines[engine] = _build(name, engine, dtype, mesh, backward_prefetch=backward_prefetch)
            step(engine)
            step(engine)
        gc.collect()
        # The step before, profiled too: each engine's frees of what it allocated there
        # (FSDP2's last reduce-scatter input, our gradient shards) are then counted.
        result[engine]["peak_live_bytes"] = peak_live_bytes(
            functools.partial(step, engine),
            include_live=True,
            lead_in=functools.partial(step, engine),
        )
    result["floor"] = _cpu_floor(name, dtype, groups, batch, seq)
    result["time_ratio"] = result["ours"]["median_step_s"] / result["fsdp2"]["median_step_s"]
    result["floor_ratio"] = result["floor"]["floor_s"] / result["fsdp2"]["median_step_s"]
    result["peak_ratio"] = result["ours"]["peak_live_bytes"] / result["fsdp2"]["peak_live_bytes"]
    return result


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    import ragged_placement  # noqa: F401

    results = []
    for name in args.models:
        for dtype in args.dtypes:
            results.append(
                _case(name, dtype, args.steps, args.batch, args.seq, args.backward_prefetch)
            )
            if rank == 0:
                _print(results[-1])
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # interpreter teardown after gloo work can abort spuriously


def _print(r: dict[str, Any]) -> None:
    ours, theirs = r["ours"], r["fsdp2"]
    print(
        f"{r['model']:5} {r['dtype']} W={r['world']}: step {ours['median_step_s'] * 1e3:7.1f} / "
        f"{theirs['median_step_s'] * 1e3:7.1f} ms = {r['time_ratio']:.3f}x | peak live "
        f"{ours['peak_live_bytes'] / 1e6:7.1f} / {theirs['peak_live_bytes'] / 1e6:7.1f} MB = "
        f"{r['peak_ratio']:.3f}x | copies {ours['copy_kernels']} kernels "
        f"{ours['copy_bytes'] / 1e6:.1f} MB / {theirs['copy_kernels']} kernels "
        f"{theirs['copy_bytes'] / 1e6:.1f} MB | received {ours['wire_bytes_received'] / 1e6:.1f}"
        f" / {theirs['wire_bytes_received'] / 1e6:.1f} MB | padding {ours['padding_bytes']:,} /"
        f" {theirs['padding_bytes']:,} B",
        flush=True,
    )
    floor = r["floor"]
    print(
        f"    floor for any engine on gloo's all-gather/reduce-scatter: "
        f"{floor['floor_s'] * 1e3:7.1f} ms = {r['floor_ratio']:.3f}x FSDP2 (per rank: forward+"
        f"backward {floor['compute_cpu_s'] * 1e3:.0f} + collectives "
        f"{floor['comm_cpu_s'] * 1e3:.0f} CPU ms, {floor['cores']} cores)",
        flush=True,
    )
    for engine in ("ours", "fsdp2"):
        b = r[engine]["breakdown_s"]
        print(
            f"    {engine:5} profiled step {b['total'] * 1e3:7.1f} ms: compute "
            f"{b['compute'] * 1e3:7.1f}, exposed comm {b['comm'] * 1e3:6.1f}, copies "
            f"{b['copies'] * 1e3:5.1f}, alloc {b['alloc'] * 1e3:5.1f}",
            flush=True,
        )


def _plot(results: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['dtype']} W={r['world']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(6, len(results) * 1.2), 4))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r["time_ratio"] for r in results], 0.4, label="step time")
    ax.bar([x + 0.2 for x in xs], [r["peak_ratio"] for r in results], 0.4, label="peak live")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ours / FSDP2")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,3,4")
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "bench")
    parser.add_argument(
        "--no-backward-prefetch",
        dest="backward_prefetch",
        action="store_false",
        help="diagnostic: ours gathers each group in backward only when it is reached",
    )
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.dtypes = args.dtypes.split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or args.steps < 7:
        parser.error(f"models must be among {sorted(MODELS)} and --steps >= 7")
    if not set(args.dtypes) <= {"fp32", "bf16", "fp8"}:
        parser.error(f"dtypes must be among fp32, bf16, fp8; got {args.dtypes}")
    for name in args.models:
        print(f"{name}: {MODELS[name]}")
    print(f"micro-batch {args.batch} x {args.seq} tokens per rank, AdamW, gloo, 1 thread per rank")
    results: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    for world in (int(w) for w in args.worlds.split(",")):
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [
                ctx.Process(target=_rank, args=(r, world, f"{tmp}/rdzv", args, out))
                for r in range(world)
            ]
            for proc in procs:
                proc.start()
            while True:  # a rank that dies must not leave us waiting forever
                try:
                    results += out.get(timeout=5)
                    break
                except queue.Empty:
                    dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode]
                    if dead:
                        print(f"a rank died (exit codes {dead}) at W={world}", file=sys.stderr)
                        return 1
            for proc in procs:
                proc.join()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(results, indent=1))
    _plot(results, args.out / "engine.png")
    print(f"wrote {args.out / 'engine.json'} and {args.out / 'engine.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
