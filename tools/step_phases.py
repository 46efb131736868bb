"""Times each phase of a training step (forward, backward, clip, optimizer) for both engines.

One rank, the example decoder, bf16 parameters with fp32 reduction, torch's default AdamW
(foreach on CUDA). Every phase ends with a device synchronize, so the phases show where
host-side overhead (hooks, DTensor dispatch) sits when the device is fast. Used by
tools/gpu_checks.sh; runs on CPU too.

Usage: python tools/step_phases.py [--device cuda] [--experts N] [--profile]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

import fsdp_engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from model import Config, Decoder, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--experts", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="a tiny model: overhead only")
    parser.add_argument("--profile", action="store_true", help="print profiler tables too")
    args = parser.parse_args()
    device = args.device
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/rdv", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import ragged_placement  # noqa: F401

    mesh = init_device_mesh(device, (1,))
    if args.small:
        cfg = Config(
            vocab=256, dim=64, num_heads=2, num_layers=8, hidden=128, num_experts=args.experts
        )
        shape = (1, 16)
    else:
        cfg = Config(
            vocab=65, dim=512, num_heads=8, num_layers=8, hidden=1408, num_experts=args.experts
        )
        shape = (16, 256)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build(engine: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Decoder(cfg).to(device)
        fully_shard: Callable[..., Any] = (
            fsdp_engine.fully_shard if engine == "ours" else torch_fsdp.fully_shard
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    engines = {e: build(e) for e in ("ours", "fsdp2")}
    tokens = torch.randint(0, cfg.vocab, shape, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def phases(engine: str) -> dict[str, float]:
        model, opt = engines[engine]
        marks = [time.perf_counter()]

        def mark() -> None:
            sync()
            marks.append(time.perf_counter())

        loss = loss_fn(model(tokens), tokens)
        mark()
        loss.backward()  # type: ignore[no-untyped-call]
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark()
        opt.step()
        opt.zero_grad()
        mark()
        names = ("forward", "backward", "clip", "optimizer")
        return {n: b - a for n, a, b in zip(names, marks[:-1], marks[1:], strict=True)}

    for engine in engines:
        for _ in range(3):
            phases(engine)
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
    for _ in range(10):
        for engine in engines:  # alternating
            runs[engine].append(phases(engine))
    print(
        f"{device}, {sum(p.numel() for p in engines['ours'][0].parameters()):,} params, "
        f"{args.experts} experts, median of 10 (ms):"
    )
    for engine, rows in runs.items():
        cells = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
        total = statistics.median(sum(r.values()) for r in rows) * 1e3
        print(
            f"  {engine:6s} step {total:7.1f}  "
            + "  ".join(f"{k} {v:6.1f}" for k, v in cells.items())
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        for engine in engines:
            with profile(activities=activities) as prof:
                for _ in range(3):
                    phases(engine)
            print(f"===== {engine}, 3 steps")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
