"""Host overhead per training step, fsdp_engine against torch FSDP2 (`nox -s bench -- overhead`).

One process plays rank 0 of W ranks on torch's fake process group (collectives are no-ops),
so what is timed is one rank's own work: hooks, Python, DTensor dispatch, copies, allocations
and the model's ops. That is what bounds a GPU step of a model with many small parameters
(an MoE with many experts), where the device waits for the host. The models are small on
purpose: the ops are cheap, so the engines' host work is most of the step, as on a GPU.

Per case (model x W x dtype) both engines train the same model on the same tokens and the
same routing, alternating step by step; the median of `--steps` steps after warm-up. Printed
per case: the step and its phases (forward; backward; optimizer = the user's
`list(model.parameters())` + clip_grad_norm_ + AdamW step + zero_grad: for ours
`fsdp_engine.clip_grad_norm_` and `ragged_optimizers.AdamW`, which step each run of adjacent
parameter pieces as one tensor; for FSDP2 and the model alone torch's `clip_grad_norm_` and
`AdamW(foreach=True)`), the ratio ours / FSDP2 of the step, of the optimizer phase and of its
clip + step alone (the walk of the parameters is torch's nn.Module code, the same for both
engines and ~0.5 ms for moe16 on this CPU), Python function calls per step
(cProfile; "plain" is the same model and step without any FSDP, so calls minus plain is the
engine's share), ATen ops per step (profiler; CUDA kernels too on a GPU), fake-tensor sharding
propagations per step (0 in a steady state), and peak allocated bytes (the profiler's memory
events on CPU; `max_memory_allocated` and reserved on CUDA).

The fake group gathers nothing, so the unsharded weights hold whatever the memory held: the
MoE routing is forced (the same tokens go to the same experts in both engines), which keeps
the work the same whatever the values. Cases:
- dense: the example decoder (RMSNorm, attention, SwiGLU);
- moe16 / moe64: 16 / 64 experts per block, each its own nn.Linears, every expert used;
- moe64-unused: as moe64, but each step a different quarter of each block's experts gets no
  token (their gradients are missing in that step, a different set every step);
- fused64: 64 experts per block held as one [64, ...] parameter per projection.

Run: `python benchmarks/bench_overhead.py [--worlds 8,64] [--cases ...] [--device cuda]`.
Results go to build/bench/overhead.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pathlib
import pstats
import statistics
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from model import Config, Decoder, MoE, loss_fn  # noqa: E402
from profiling import peak_live_bytes  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A model and how its experts are routed."""

    cfg: Config
    unused_fraction: float = 0.0  # of each block's experts that get no token, per step


_BASE = {"vocab": 256, "dim": 64, "num_heads": 2, "num_layers": 2, "hidden": 128}
CASES = {
    "dense": Case(Config(**_BASE)),
    "moe16": Case(Config(**_BASE, num_experts=16)),
    "moe64": Case(Config(**_BASE, num_experts=64)),
    "moe64-unused": Case(Config(**_BASE, num_experts=64), unused_fraction=0.25),
    "fused64": Case(Config(**_BASE, num_experts=64, fused_experts=True)),
}
DTYPES = ("bf16", "fp32")
ENGINES = ("ours", "fsdp2")
ALL_USED = "ours-all-used"  # ours on the same model, every expert used (the varying case)


def _build(case: Case, engine: str, dtype: str, mesh: Any, device: str) -> tuple[Any, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Decoder(case.cfg).to(device)
    if engine != "plain":
        policy = MixedPrecisionPolicy()
        if dtype == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if engine == "ours":
            from fsdp_engine import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if case.cfg.num_experts:
            # Unused experts: FSDP2 needs this to keep its reduce-scatters the same size on
            # every rank; it then reduces zeros for them. Ours reduces what was used.
            # (FSDP2 before torch 2.13 lacks the setter; the fake group's collectives are
            # no-ops, so there is nothing to keep the same size.)
            set_unused = getattr(model, "set_reduce_scatter_unused_params", None)
            if set_unused is not None:
                set_unused(engine == "fsdp2")
    elif dtype == "bf16":
        model = model.to(torch.bfloat16)  # the plain reference computes in the same dtype
    if engine == "ours":
        from ragged_optimizers import AdamW

        return model, AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


class Routing:
    """The forced routing of each step: the same for every engine."""

    def __init__(self, case: Case, tokens: int, device: str, seed: int) -> None:
        self.case, self.tokens, self.device, self.seed = case, tokens, device, seed
        self._cache: dict[int, list[torch.Tensor]] = {}

    def choices(self, index: int) -> list[torch.Tensor]:
        """Per block, (tokens, top_k) expert indices; every active expert gets a token."""
        if index not in self._cache:
            cfg = self.case.cfg
            gen = torch.Generator().manual_seed(self.seed + index)
            per_block = []
            for _ in range(cfg.num_layers):
                order = torch.randperm(cfg.num_experts, generator=gen)
                num_unused = int(cfg.num_experts * self.case.unused_fraction)
                active = order[num_unused:]
                first = active[torch.arange(self.tokens) % len(active)]
                # A second expert, different from the first, also among the active ones.
                shift = torch.randint(1, len(active), (self.tokens,), generator=gen)
                position = (torch.arange(self.tokens) % len(active) + shift) % len(active)
                per_block.append(torch.stack([first, active[position]], 1).to(self.device))
            self._cache = {index: per_block}  # one step at a time
        return self._cache[index]

    def apply(self, model: torch.nn.Module, index: int) -> None:
        if not self.case.cfg.num_experts:
            return
        for layer, choice in zip(model.layers, self.choices(index), strict=True):  # type: ignore[arg-type]
            mlp = layer.mlp
            assert isinstance(mlp, MoE)
            mlp.forced_choice = choice


# Seconds: forward, backward, optimizer (the whole phase), and its clip + step alone.
Phases = tuple[float, float, float, float]


def _phases(
    model: Any,
    opt: Any,
    tokens: torch.Tensor,
    sync: Callable[[], None],
    profilers: tuple[cProfile.Profile, cProfile.Profile] | None = None,
) -> Phases:
    """One training step, timed per phase; `profilers` count forward + backward and the
    optimizer apart."""
    sync()
    t0 = time.perf_counter()
    if profilers:
        profilers[0].enable()
    loss = loss_fn(model(tokens), tokens)
    sync()
    t1 = time.perf_counter()
    loss.backward()
    sync()
    t2 = time.perf_counter()
    if profilers:
        profilers[0].disable()
        profilers[1].enable()
    # The user's walk of the parameters, each step, as torchtitan's and accelerate's clip
    # calls do: torch's, the same for every engine.
    params = list(model.parameters())
    t_clip = time.perf_counter()
    if isinstance(opt, torch.optim.AdamW):
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    else:
        from fsdp_engine import clip_grad_norm_

        clip_grad_norm_(params, 1.0)
    opt.step()
    sync()
    t_step = time.perf_counter()
    opt.zero_grad()
    sync()
    t3 = time.perf_counter()
    if profilers:
        profilers[1].disable()
    return t1 - t0, t2 - t1, t3 - t2, t_step - t_clip


def _python_calls(
    step: Callable[[tuple[cProfile.Profile, cProfile.Profile]], object],
) -> dict[str, int]:
    """Python function calls in one step (forward + backward; optimizer) and the fake-tensor
    sharding propagations in it."""
    profilers = (cProfile.Profile(), cProfile.Profile())
    step(profilers)
    counts = [pstats.Stats(p) for p in profilers]
    propagations = sum(
        count
        for stats in counts
        for (_, _, name), (count, *_) in stats.stats.items()  # type: ignore[attr-defined]
        if name == "_propagate_tensor_meta_non_cached"
    )
    return {
        "calls_forward_backward": counts[0].total_calls,  # type: ignore[attr-defined]
        "calls_optimizer": counts[1].total_calls,  # type: ignore[attr-defined]
        "propagations": propagations,
    }


def _ops(step: Callable[[], object], device: str) -> tuple[int, int]:
    """(ATen ops, device kernels) in one step, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
    assert prof.profiler is not None
    # The raw events: building torch's FunctionEvent tree costs seconds per step here.
    events = prof.profiler.kineto_results.events()
    ops = sum(1 for e in events if e.name().startswith("aten::"))
    kernels = sum(1 for e in events if e.device_type() == torch.autograd.DeviceType.CUDA)
    return ops, kernels


def _peak(step: Callable[[], object], device: str) -> dict[str, int]:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return {
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
        }
    # The step before runs under the same profiler: frees of what it allocated then count.
    return {"peak_allocated": peak_live_bytes(step, include_live=True, lead_in=step)}


def run_case(name: str, world: int, dtype: str, steps: int, device: str) -> dict[str, Any]:
    """Both engines, and the model alone ("plain"), on one case; see the module docstring."""
    from torch.distributed.device_mesh import init_device_mesh

    case = CASES[name]
    mesh = init_device_mesh(device, (world,))
    batch, seq = 2, 32
    seed = zlib.crc32(f"{name} {world} {dtype}".encode())  # another routing per case
    routing = {"": Routing(case, batch * seq, device, seed)}
    # The varying case also runs ours on all experts, in the same alternation.
    runs = [*ENGINES, "plain"]
    if case.unused_fraction:
        routing[ALL_USED] = Routing(replace(case, unused_fraction=0.0), batch * seq, device, seed)
        runs.append(ALL_USED)
    tokens = torch.randint(
        0, case.cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(0)
    ).to(device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    models = {run: _build(case, run.split("-")[0], dtype, mesh, device) for run in runs}
    index = 0

    def step(run: str, profilers: Any = None) -> Phases:
        model, opt = models[run]
        routing.get(run, routing[""]).apply(model, index)
        return _phases(model, opt, tokens, sync, profilers)

    times: dict[str, list[Phases]] = {run: [] for run in runs}
    for index in range(steps + 2):  # two warm-up steps
        # Alternating on the same routing, each run first in turn (the machine's state
        # drifts; no run always follows the same one).
        for run in runs[index % len(runs) :] + runs[: index % len(runs)]:
            phases = step(run)
            if index >= 2:
                times[run].append(phases)
    result: dict[str, Any] = {"case": name, "world": world, "dtype": dtype, "device": device}
    for run in runs:
        rows = times[run]
        index += 1
        calls = _python_calls(lambda profilers, r=run: step(r, profilers))  # type: ignore[misc]
        index += 1
        ops, kernels = _ops(lambda r=run: step(r), device)  # type: ignore[misc]
        result[run] = {
            "step_s": statistics.median(sum(r) for r in rows),
            "forward_s": statistics.median(r[0] for r in rows),
            "backward_s": statistics.median(r[1] for r in rows),
            "optimizer_s": statistics.median(r[2] for r in rows),
            "clip_step_s": statistics.median(r[3] for r in rows),
            **calls,
            "aten_ops": ops,
            "kernels": kernels,
            "num_params": sum(1 for _ in models[run][0].parameters()),
        }
    # Peak memory with one engine's model alive at a time (live bytes count everything).
    for run in [r for r in models if r not in ENGINES]:
        del models[run]
    for engine in ENGINES:
        for other in [e for e in models if e != engine]:
            del models[other]
        if engine not in models:
            models[engine] = _build(case, engine, dtype, mesh, device)
            for _ in range(2):
                step(engine)
        gc.collect()
        result[engine].update(_peak(lambda e=engine: step(e), device))  # type: ignore[misc]
    models.clear()
    gc.collect()
    ours, theirs, plain = result["ours"], result["fsdp2"], result["plain"]
    result["ratio"] = ours["step_s"] / theirs["step_s"]
    result["optimizer_ratio"] = ours["optimizer_s"] / theirs["optimizer_s"]
    result["clip_step_ratio"] = ours["clip_step_s"] / theirs["clip_step_s"]
    result["peak_ratio"] = ours["peak_allocated"] / theirs["peak_allocated"]
    # The model's own forward and backward plus the faster of the two optimizer phases: what
    # a sharding engine with FSDP2's API adds nothing to.
    floor = plain["forward_s"] + plain["backward_s"]
    floor += min(ours["optimizer_s"], theirs["optimizer_s"])
    result["floor_s"] = floor
    result["floor_ratio"] = floor / theirs["step_s"]
    return result


COLUMNS = (
    "case",
    "dtype",
    "W",
    "step ms, ours / FSDP2",
    "ratio",
    "floor ratio",
    "opt ratio",
    "clip + step ratio",
    "fwd / bwd / opt ms, ours",
    "fwd / bwd / opt ms, FSDP2",
    "Python calls fwd+bwd, ours / FSDP2 / model alone",
    "Python calls opt, ours / FSDP2",
    "ATen ops, ours / FSDP2",
    "propagations, ours / FSDP2",
    "peak allocated MB, ours / FSDP2",
    "peak ratio",
    "ours with every expert used, ms",
)
CUDA_COLUMNS = ("kernels, ours / FSDP2", "peak reserved ratio")


def _print_header(device: str) -> None:
    columns = COLUMNS + (CUDA_COLUMNS if device == "cuda" else ())
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))


def _print_row(r: dict[str, Any]) -> None:
    ours, theirs, plain = r["ours"], r["fsdp2"], r["plain"]

    def phases(e: dict[str, Any]) -> str:
        return " / ".join(f"{e[k] * 1e3:.1f}" for k in ("forward_s", "backward_s", "optimizer_s"))

    def pair(key: str, scale: float = 1.0, fmt: str = ",.0f") -> str:
        return f"{ours[key] * scale:{fmt}} / {theirs[key] * scale:{fmt}}"

    all_used = r.get(ALL_USED)
    cells = [
        r["case"],
        r["dtype"],
        str(r["world"]),
        pair("step_s", 1e3, ".1f"),
        f"{r['ratio']:.3f}",
        f"{r['floor_ratio']:.3f}",
        f"{r['optimizer_ratio']:.3f}",
        f"{r['clip_step_ratio']:.3f}",
        phases(ours),
        phases(theirs),
        f"{pair('calls_forward_backward')} / {plain['calls_forward_backward']:,}",
        pair("calls_optimizer"),
        pair("aten_ops"),
        pair("propagations"),
        pair("peak_allocated", 1e-6, ".2f"),
        f"{r['peak_ratio']:.3f}",
        f"{all_used['step_s'] * 1e3:.1f}" if all_used else "-",
    ]
    if r["device"] == "cuda":
        cells.append(pair("kernels"))
        cells.append(f"{ours['peak_reserved'] / theirs['peak_reserved']:.3f}")
    print("| " + " | ".join(cells) + " |", flush=True)


def _case_process(job: tuple[str, int, str, int, str], queue: Any) -> None:
    name, world, dtype, steps, device = job
    try:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)  # values are garbage under the fake group: keep them cheap
        from torch.testing._internal.distributed.fake_pg import FakeStore

        import ragged_placement  # noqa: F401

        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        queue.put(run_case(name, world, dtype, steps, device))
        dist.destroy_process_group()
    except Exception:  # the parent reports it
        queue.put(traceback.format_exc())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,64", help="comma-separated world sizes")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="bf16 (fp32 reduce), fp32")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per engine (>= 7)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(ROOT / "build" / "bench" / "overhead.json"))
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    names = args.cases.split(",")
    dtypes = args.dtypes.split(",")
    for value, valid, what in ((names, CASES, "case"), (dtypes, DTYPES, "dtype")):
        unknown = sorted(set(value) - set(valid))
        if unknown:
            parser.error(f"unknown {what} {unknown}; valid: {', '.join(valid)}")
    if args.steps < 7:
        parser.error(f"--steps must be >= 7, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    results = []
    start = time.perf_counter()
    _print_header(args.device)
    # On CPU forked from this process, which has imported torch and our packages but run
    # nothing (a spawned process would import them again for each case); CUDA needs spawn.
    torch.set_num_threads(1)
    import ragged_placement  # noqa: F401

    spawn = mp.get_context("spawn" if args.device == "cuda" else "fork")
    for world in worlds:
        for name in names:
            for dtype in dtypes:
                # A process per case: no sharding decision, allocator state or warm cache
                # carries over from another case with the same layout.
                queue = spawn.SimpleQueue()
                job = (name, world, dtype, args.steps, args.device)
                process = spawn.Process(target=_case_process, args=(job, queue))
                process.start()
                result = queue.get()
                process.join()
                if isinstance(result, str):
                    raise RuntimeError(f"case {job} failed:\n{result}")
                results.append(result)
                _print_row(result)
    print(f"{len(results)} cases in {time.perf_counter() - start:.0f} s")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
