"""What is live at the memory peak of one training step, ours against torch FSDP2 (gloo, CPU).

A diagnostic for `nox -s bench -- engine`'s peak-live column: it runs one case of that bench
(same models, same step) and, for each engine alone, replays the profiler's allocation events
of one step, finds the instant of the peak and prints the allocations live then, grouped by the
profiler range and op that made them, largest first. What was live when the step began is
listed by size as well (parameters, optimizer state, the engine's persistent buffers).

    python tools/peak_live.py --world 4 --model moe --dtype fp32
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import pathlib
import sys
import tempfile
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "packages" / "fsdp-engine" / "benchmarks"))

from bench_engine import MODELS, _build  # noqa: E402
from model import loss_fn  # noqa: E402
from profiling import live_storages, live_tensor_bytes  # noqa: E402


def _label(event: Any) -> str:
    # The innermost named range (ours and FSDP2 both open ranges per group) and the op; an
    # allocation with none made on another thread (gloo's workers) says which.
    op, scope = event.parent.name if event.parent else "?", []
    node = event.parent
    while node is not None:
        if not node.name.startswith("aten::") and "::" in node.name:
            scope.append(node.name)
            break
        node = node.parent
    root = event
    while root.parent is not None:
        root = root.parent
    where = scope[0] if scope else f"thread {event.start_tid} under {root.name}"
    return f"{where} / {op}"


def _live_at_peak(prof: Any, window_name: str) -> tuple[int, str, list[tuple[str, int]]]:
    tree = prof.profiler.kineto_results.experimental_event_tree()
    events: list[Any] = []
    stack = list(tree)
    window = None
    while stack:
        e = stack.pop()
        if e.name == window_name:
            window = e
        if type(e.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append(e)
        stack.extend(e.children)
    assert window is not None
    begin, end = window.start_time_ns, window.end_time_ns
    events.sort(key=lambda e: e.start_time_ns)
    inside = [e for e in events if begin <= e.start_time_ns <= end]
    running = peak = 0
    peak_index = -1
    for index, e in enumerate(inside):
        running += e.extra_fields.alloc_size
        if running > peak:
            peak, peak_index = running, index
    live: dict[int, tuple[str, int]] = {}
    for e in inside[: peak_index + 1]:
        if e.extra_fields.alloc_size > 0:
            live[e.extra_fields.ptr] = (_label(e), e.extra_fields.alloc_size)
        else:
            live.pop(e.extra_fields.ptr, None)
    peak_live = live
    at = _label(inside[peak_index]) if peak_index >= 0 else "-"
    groups: collections.Counter[str] = collections.Counter()
    for label, size in peak_live.values():
        if size:
            groups[label] += size
    return peak, at, groups.most_common()


def _rank(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import ragged_placement  # noqa: F401

    mesh = init_device_mesh("cpu", (world,))
    vocab = MODELS[args.model].vocab
    for engine in args.engines.split(","):
        model, opt = _build(args.model, engine, args.dtype, mesh)
        gen = torch.Generator().manual_seed(rank)

        def step(model: Any = model, opt: Any = opt, gen: Any = gen) -> None:
            tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
            loss_fn(model(tokens), tokens).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
            start = live_tensor_bytes()
            sizes = collections.Counter(live_storages().values()).most_common()
            with record_function("peak_live::window"):
                step()
        peak, at, groups = _live_at_peak(prof, "peak_live::window")
        if rank == args.show_rank:
            print(
                f"== {engine} rank {rank}: live at start {start / 1e6:.1f} MB + peak in step "
                f"{peak / 1e6:.1f} MB = {(start + peak) / 1e6:.1f} MB (peak at {at})",
                flush=True,
            )
            print("   live at start, by storage size:", flush=True)
            for size, count in sizes[: args.top]:
                print(f"     {count:4d} x {size / 1e6:9.3f} MB", flush=True)
            print("   allocated in the step and live at its peak:", flush=True)
            for label, size in groups[: args.top]:
                print(f"     {size / 1e6:9.3f} MB  {label}", flush=True)
        del model, opt, step, prof
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", default="moe", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--show-rank", type=int, default=0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--engines", default="fsdp2,ours")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, args.world, f"{tmp}/rdzv", args))
            for r in range(args.world)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())
