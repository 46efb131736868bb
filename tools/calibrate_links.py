"""Measures all-gather and reduce-scatter times on this machine and writes a calibration file.

shard-planner's cost model prices a ring collective over W ranks as `latency + (W - 1) * hop
+ (W - 1) * shard bytes / bandwidth`; this tool times the two collectives FSDP runs (one
rank's shard of each size, equal shards, on every W asked for), writes them as the JSON that
`shard_planner.load_links` reads (`shard-planner advise --links FILE`), and prints the fitted
figures. Here every rank shares one machine, so the measurements are "inside a node"; run it
across nodes (torchrun) to measure the other kind.

Usage:
    python tools/calibrate_links.py --out build/links.json [--worlds 2,3,4]
        [--sizes-kib 64,256,1024,4096] [--repeats 5] [--backend gloo]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import spawn

from shard_planner import Links, fit_links


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def collectives() -> dict[str, Any]:
    # torch 2.13 renamed the single-tensor collectives; older ones have only the old names.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {"all_gather": gather, "reduce_scatter": scatter}


def measure_collectives(
    sizes_kib: list[int], repeats: int, device: torch.device
) -> list[dict[str, Any]]:
    """Times both collectives at each shard size on the initialized default group.

    Returns the calibration records (the slowest rank's median time of each), on every rank.
    """
    world = dist.get_world_size()
    results = []
    for name, collective in collectives().items():
        for kib in sizes_kib:
            numel = kib * 1024 // 4
            shard = torch.ones(numel, device=device)
            full = torch.empty(numel * world, device=device)
            times = []
            for attempt in range(repeats + 2):  # two warm-up runs
                dist.barrier()
                start = time.perf_counter()
                if name == "all_gather":
                    collective(full, shard)
                else:
                    collective(shard, full)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if attempt >= 2:
                    times.append(time.perf_counter() - start)
            # The slowest rank's time is the collective's: take each run's maximum over ranks.
            worst = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            results.append(
                {
                    "collective": name,
                    "world": world,
                    "bytes": numel * 4,
                    "seconds": statistics.median(worst.tolist()),
                    "inter_node": False,
                }
            )
    return results


def _rank(
    rank: int, world: int, port: int, args: argparse.Namespace, out: Any
) -> None:  # a spawned process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    results = measure_collectives(args.sizes_kib, args.repeats, device)
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    measurements: list[dict[str, Any]] = []
    for world in args.worlds:
        queue = context.SimpleQueue()
        spawn(_rank, args=(world, free_port(), args, queue), nprocs=world)
        measurements += queue.get()
    return measurements


def parse_ints(text: str) -> list[int]:
    values = [int(item) for item in text.split(",") if item.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="calibration JSON to write")
    parser.add_argument("--worlds", type=parse_ints, default=[2, 3, 4])
    parser.add_argument("--sizes-kib", type=parse_ints, default=[64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    if min(args.worlds) < 2:
        parser.error("--worlds: a collective needs 2 ranks or more")
    measurements = _measure(args)
    ranks_per_node = max(args.worlds)  # all on this machine
    doc = {
        "backend": args.backend,
        "ranks_per_node": ranks_per_node,
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "measurements": measurements,
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    links = fit_links(
        measurements,
        ranks_per_node=ranks_per_node,
        default=Links(400.0, 50.0, 20.0, 2.0, ranks_per_node),
    )
    print(f"wrote {len(measurements)} measurements to {path}")
    print(
        f"fitted inside a node: {links.intra_node_gbps:.2f} GB/s per rank, "
        f"{links.latency_us:.1f} us per collective, {links.hop_latency_us:.1f} us per ring step"
    )
    for row in measurements:
        steps = row["world"] - 1
        predicted = (
            links.latency_us * 1e-6
            + steps * links.hop_latency_us * 1e-6
            + steps * row["bytes"] / (links.intra_node_gbps * 1e9)
        )
        print(
            f"  {row['collective']:<14} W={row['world']} {row['bytes'] // 1024:>6} KiB: "
            f"measured {row['seconds'] * 1e3:8.3f} ms, model {predicted * 1e3:8.3f} ms "
            f"({predicted / row['seconds'] - 1:+.0%})"
        )


if __name__ == "__main__":
    main()
