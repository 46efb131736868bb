"""RaggedShard redistribution against torch's Shard(0), side by side in one run (gloo, CPU).

Run: `nox -s bench -- placement` (or `python benchmarks/bench_placement.py [--world-size 4]`).

For tensors of 1M-64M fp32 elements, on every rank, alternating ours and torch's:
- gather:  RaggedShard -> Replicate     vs  Shard(0) -> Replicate
- scatter: Replicate -> RaggedShard     vs  Replicate -> Shard(0)        (local slices)
- reshard: RaggedShard -> RaggedShard'  vs  Shard(0) -> Shard(1)         (one all-to-all each)
Prints the median time of each on the slowest rank and the ratio ours / torch, plus the
ratio of bytes received by all ranks together (CommCounter). Balanced units are the
like-for-like case (target: bytes ratio <= 1.0, time ratio <= 1.2); uneven units (one rank
holding nothing, one holding two shares) are shown for reference. On CPU, torch's
Shard(0) -> Shard(1) falls back to all-gather + chunk (gloo has no all_to_all_single path in
DTensor), so the reshard row compares against that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
ROW = 1024


def _timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


Case = tuple[str, Callable[[], object], Callable[[], object]]


def _cases(mesh: Any, full: torch.Tensor, world: int) -> list[Case]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ragged_placement import RaggedShard

    rows = full.shape[0]
    balanced = RaggedShard((0,), (1,) * world)
    uneven = RaggedShard((0,), (0, *((1,) * (world - 2)), 2)) if world > 1 else balanced
    shifted = RaggedShard((0,), (2, *((1,) * (world - 2)), 0)) if world > 1 else balanced
    s0 = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    rep = distribute_tensor(full, mesh, [Replicate()], src_data_rank=None)
    cases: list[Case] = []
    for label, units in (("balanced", balanced), ("uneven", uneven)):
        if rows % sum(units.local_units):
            continue
        ours = distribute_tensor(full, mesh, [units], src_data_rank=None)

        def gather(o: Any = ours) -> object:
            return o.redistribute(mesh, [Replicate()])

        def scatter(u: Any = units) -> object:
            return rep.redistribute(mesh, [u])

        cases.append((f"gather {label}", gather, lambda: s0.redistribute(mesh, [Replicate()])))
        cases.append((f"scatter {label}", scatter, lambda: rep.redistribute(mesh, [Shard(0)])))
    if rows % sum(shifted.local_units) == 0:
        ours_b = distribute_tensor(full, mesh, [balanced], src_data_rank=None)
        cases.append(
            (
                "reshard balanced->shifted",
                lambda: ours_b.redistribute(mesh, [shifted]),
                lambda: s0.redistribute(mesh, [Shard(1)]),
            )
        )
    return cases


def _rank(rank: int, world: int, init_file: str, sizes: tuple[int, ...], repeats: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # ragged_placement first: it wraps distribute_tensor, so bind that name afterwards.
    from torch.distributed.tensor import init_device_mesh

    from ragged_placement import CommCounter

    mesh = init_device_mesh("cpu", (world,))
    if rank == 0:
        print(f"world size {world}, gloo, fp32, rows of {ROW} elements, median of {repeats}")
        print(
            f"{'case':<28} {'numel':>9} {'ours ms':>9} {'torch ms':>9} {'time x':>7} {'bytes x':>8}"
        )
    for numel in sizes:
        cases = _cases(mesh, torch.randn(numel // ROW, ROW), world)
        for label, ours_fn, torch_fn in cases:
            ours_fn()
            torch_fn()  # warm up both
            ours_t, torch_t = [], []
            for _ in range(repeats):  # alternate so that noise hits both alike
                ours_t.append(_timed(ours_fn, 1))
                torch_t.append(_timed(torch_fn, 1))
            with CommCounter() as ours_c:
                ours_fn()
            with CommCounter() as torch_c:
                torch_fn()
            # The slowest rank's time, and the bytes received by all ranks together.
            stats = torch.tensor(
                [statistics.median(ours_t), statistics.median(torch_t)], dtype=torch.float64
            )
            volume = torch.tensor(
                [ours_c.bytes_received, torch_c.bytes_received], dtype=torch.float64
            )
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            dist.all_reduce(volume)
            if rank == 0:
                o, t = stats.tolist()
                ob, tb = volume.tolist()
                bytes_ratio = f"{ob / tb:8.3f}" if tb else f"{'0/0' if not ob else 'inf':>8}"
                times = f"{o * 1e3:>9.2f} {t * 1e3:>9.2f} {o / t:>7.2f}"
                print(f"{label:<28} {numel:>9} {times} {bytes_ratio}")
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown, which can abort after gloo work (see tests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="sizes up to 4M only")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank,
            args=(args.world_size, os.path.join(tmp, "rdzv"), sizes, args.repeats),
            nprocs=args.world_size,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
