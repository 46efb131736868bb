"""Distributed Muon and AdamW8bit on the engine benchmark's dense model, gloo, W = 2 and 4.

Run: `nox -s bench -- optimizers` (or `python benchmarks/bench_optimizers.py`).

The model is the engine benchmark's dense decoder (8 blocks of dim 512, vocabulary 32,000,
58.5M parameters) under fully_shard(block_rows=32). Gradients are random sharded tensors (the
optimizer step alone is timed). Muon runs on the 40 hidden matrices (AdamW on the rest) in
three ways, alternating in one run:
- "lpt": ragged_optimizers.Muon, one owner per matrix by the LPT plan;
- "round_robin": the same exchange with owner = matrix index mod W;
- "redundant": what an FSDP2 user has today: every rank gathers every full matrix (bf16) and
  runs Newton-Schulz on all of them, then keeps its piece.
AdamW8bit runs against torch.optim.AdamW (foreach) and ragged_optimizers.AdamW on all
parameters. Reported per W: the
slowest rank's median step, FLOPs makespan of the owner plans, bytes each rank sends per step,
and state bytes. First, in this process: AdamW8bit's step (native, compiled, eager) against foreach
AdamW on plain matrices, one thread, with the compile time (the first step) apart
(`--adam-only` for just that), and Muon's host cost on an MoE's expert matrices, batched
against one matrix at a time (`--experts-only` for just that). At W=4, Muon per mesh (FSDP,
HSDP 2 x 2, (dp, tp) = (2, 2); `--meshes-only` for just that): this version against the path
each mesh had before (one batch per shape; every replica; every tp rank) and the redundant
baseline, with the busiest rank's Newton-Schulz FLOPs counted and the owners' host time
waiting for pieces against orthogonalizing. Writes build/bench/optimizers.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))


def _round_robin(names, shapes, pieces, num_ranks, ns_steps):  # type: ignore[no-untyped-def]
    from ragged_optimizers import MatrixAssignment, ns_flops

    out = []
    for i, (name, shape, held) in enumerate(zip(names, shapes, pieces, strict=True)):
        owner = i % num_ranks
        moved = sum(held) - held[owner]
        flops = ns_flops(shape, ns_steps)
        out.append(MatrixAssignment(i, name, tuple(shape), owner, flops, moved, moved))
    return tuple(out)


def _model(layout: str = "fsdp") -> Any:
    """The decoder under fully_shard: "fsdp" (1-D mesh), "hsdp" ((2, W / 2) replicate x
    shard) or "tp" ((W / 2, 2) dp x tp: Megatron tensor parallelism, then fully_shard on dp)."""
    from model import Config, Decoder
    from parallel import tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_engine import fully_shard

    torch.manual_seed(0)
    model = Decoder(Config(vocab=32000, dim=512, num_heads=8, num_layers=8, hidden=1376))
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif layout == "tp":
        grid = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, grid["tp"])
        mesh = grid["dp"]
    block = 16 if layout == "tp" else 32  # a tp rank holds 688 of the 1376 hidden rows
    rows = lambda fqn, p: block if p.dim() == 2 else 1  # noqa: E731
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, block_rows=rows)
    fully_shard(model, mesh=mesh, block_rows=rows)
    return model


def _set_grads(model: Any, seed: int) -> None:
    """Random gradients, equal across replicas (HSDP's are all-reduced over them)."""
    from torch.distributed.tensor import DTensor, Replicate

    for index, p in enumerate(model.parameters()):
        coordinate = p.device_mesh.get_coordinate() or []
        held = [
            c
            for c, pl in zip(coordinate, p.placements, strict=True)
            if not isinstance(pl, Replicate)
        ]
        gen = torch.Generator().manual_seed(hash((seed, index, *held)) % 2**31)
        local = torch.randn(p.to_local().shape, generator=gen)
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


def _muon_groups(model: Any) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if n.startswith("layers.") and p.dim() == 2]
    rest = [(n, p) for n, p in named if not (n.startswith("layers.") and p.dim() == 2)]
    return [{"params": hidden}, {"params": rest, "use_muon": False}]


class RedundantMuon:
    """Every rank gathers every matrix and orthogonalizes all of them (Moonlight-style)."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt  # ours, for the AdamW groups, momentum and the update formula

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        from ragged_optimizers._layout import layout_of
        from ragged_optimizers._muon_exchange import Item, Unit

        with torch.no_grad():
            for group in self.opt.param_groups:
                if not group["use_muon"]:
                    self.opt._adamw(group)
                    continue
                inputs = self.opt._momenta(group)  # momentum and weight decay, per run
                for p in group["params"]:
                    full = DTensor.from_local(
                        inputs[id(p)],
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    ).full_tensor()
                    layout = layout_of(p)
                    unit = Unit([Item(p, "", layout, torch.empty(0), group)])
                    (o,) = self.opt._orthogonalize_unit(unit, [full.reshape(-1)])
                    lo, hi = layout.local_range
                    self.opt._apply_unit(unit, [o[lo:hi]])


def _timed(step: Any, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
        out.append(elapsed.item())
    return out


def _state_bytes(opt: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.nbytes
    value = torch.tensor(total, dtype=torch.float64)
    dist.all_reduce(value)
    return int(value.item())


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if args.meshes_only:
        meshes = _mesh_rows(args)
        if rank == 0:
            out.put({"world": world, "meshes": meshes})
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)
    import ragged_optimizers._muon as muon
    from ragged_optimizers import AdamW, AdamW8bit, Muon, makespan
    from ragged_placement import CommCounter

    model = _model()
    num_params = sum(p.numel() for p in model.parameters())
    lpt = Muon(_muon_groups(model), lr=0.0)  # lr 0: the timings do not move the weights
    plan = lpt.owner_plan()
    rr_plan = _round_robin(
        [a.name for a in plan],
        [a.shape for a in plan],
        [[hi - lo for lo, hi in lpt._layout(p, "").ranges] for p in lpt.param_groups[0]["params"]],
        world,
        5,
    )
    variants: dict[str, Any] = {"lpt": lpt.step, "redundant": RedundantMuon(lpt).step}
    original = muon.plan_owners

    def round_robin_step() -> None:
        muon.plan_owners = _round_robin  # type: ignore[assignment]
        try:
            lpt.step()
        finally:
            muon.plan_owners = original

    variants["round_robin"] = round_robin_step
    times: dict[str, list[float]] = {k: [] for k in variants}
    sent: dict[str, int] = {}
    _set_grads(model, 0)
    for name, step in variants.items():  # warm-up, and bytes sent per step
        with CommCounter() as comms:
            step()
        mine = torch.tensor(float(comms.bytes_sent))
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        sent[name] = int(mine.item())
    for _ in range(args.rounds):
        for name, step in variants.items():
            times[name] += _timed(step, args.steps)

    # AdamW8bit against torch's foreach AdamW and ours (one tensor per run of adjacent
    # shards, the same kernels), on every parameter.
    adams = {
        "adamw8bit": AdamW8bit(model.parameters(), lr=0.0),
        "adamw_foreach": torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True),
        "adamw_flat": AdamW(model.parameters(), lr=0.0),
    }
    for opt in adams.values():
        opt.step()
    adam_times: dict[str, list[float]] = {name: [] for name in adams}
    for _ in range(args.rounds):
        for name, opt in adams.items():
            adam_times[name] += _timed(opt.step, args.steps)
    state = {name: _state_bytes(opt) for name, opt in adams.items()}
    meshes = _mesh_rows(args) if world % 2 == 0 and world >= 4 else []
    if rank == 0:
        out.put(
            {
                "meshes": meshes,
                "world": world,
                "num_params": num_params,
                "num_matrices": len(plan),
                "muon_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                "makespan_gflop": {
                    "lpt": makespan(plan, world) / 1e9,
                    "round_robin": makespan(rr_plan, world) / 1e9,
                    "total": sum(a.flops for a in plan) / 1e9,
                },
                "sent_mb_per_step": {k: v / 1e6 for k, v in sent.items()},
                "adam_ms": {k: statistics.median(v) * 1e3 for k, v in adam_times.items()},
                "state_bytes": state,
            }
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo teardown can abort spuriously at interpreter exit


class _CountNS:
    """Counts the Newton-Schulz FLOPs this rank runs inside it (Muon's own calls)."""

    def __enter__(self) -> _CountNS:
        import ragged_optimizers._muon as muon
        from ragged_optimizers import ns_flops

        self.flops, self._module, self._original = 0, muon, muon.newton_schulz

        def counting(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.flops += ns_flops(tuple(x.shape), 5)
            return self._original(x, *args, **kwargs)

        muon.newton_schulz = counting
        return self

    def __exit__(self, *exc: object) -> None:
        self._module.newton_schulz = self._original


def _one_batch_per_shape() -> Any:
    """Muon's batching before owners were balanced: a shape's matrices as few batches as
    `ns_batch_numel` allows, however many owners are left idle (a context manager)."""
    import contextlib

    import ragged_optimizers._muon_exchange as exchange

    @contextlib.contextmanager
    def patched() -> Any:
        original = exchange._balanced_batch
        exchange._balanced_batch = lambda count, num_owners: max(count, 1)
        try:
            yield
        finally:
            exchange._balanced_batch = original

    return patched()


def _max_over_ranks(value: float) -> float:
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _mesh_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Muon on the decoder at pure FSDP, HSDP (2, W/2) and (dp, tp) = (W/2, 2): this
    version against the path each mesh had before (one batch per shape; every replica;
    every tp rank) and the redundant baseline, alternating in one run. Per variant: the
    slowest rank's median step and the busiest rank's Newton-Schulz FLOPs (counted)."""
    from ragged_optimizers import Muon
    from ragged_placement import CommCounter

    rows = []
    for layout in ("fsdp", "hsdp", "tp"):
        model = _model(layout)
        ours = Muon(_muon_groups(model), lr=0.0)
        before: Any
        if layout == "fsdp":
            before_name = "one batch per shape"

            def before_step(opt: Any = ours) -> None:
                with _one_batch_per_shape():
                    opt.step()

            before = before_step
        elif layout == "hsdp":
            before_name = "every replica"
            before = Muon(_muon_groups(model), lr=0.0, replica_owners=False).step
        else:
            before_name = "every tp rank"
            before = Muon(_muon_groups(model), lr=0.0, tp_owners=False).step
        variants: dict[str, Any] = {"ours": ours.step, "before": before}
        small = None
        if layout == "fsdp":  # overlap: more, smaller buckets in flight
            small = Muon(_muon_groups(model), lr=0.0, bucket_bytes=4 * 2**20)
            variants["ours, 4 MiB buckets"] = small.step
        if layout != "tp":  # (the baseline gathers 1-D shards; tp blocks need another path)
            variants["redundant"] = RedundantMuon(ours).step
        _set_grads(model, 0)
        flops, sent = {}, {}
        for name, step in variants.items():  # warm-up: FLOPs and bytes of one step
            with _CountNS() as counted, CommCounter() as comms:
                step()
            flops[name] = _max_over_ranks(counted.flops)
            sent[name] = _max_over_ranks(comms.bytes_sent)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, step in variants.items():
                times[name] += _timed(step, args.steps)
        plan = ours.owner_plan()
        overlap = {}
        for name, opt in (("ours", ours), ("ours, 4 MiB buckets", small)):
            if opt is not None:  # the last timed step's host time, busiest rank
                overlap[name] = {k: _max_over_ranks(v) for k, v in opt.exchange_time.items()}
        rows.append(
            {
                "layout": layout,
                "before": before_name,
                "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                "busiest_ns_gflop": {k: v / 1e9 for k, v in flops.items()},
                "sent_mb": {k: v / 1e6 for k, v in sent.items()},
                "plan": str(plan),
                "overlap": overlap,
            }
        )
        del model, ours, variants
    return rows


def _hidden_matrices(preset: str) -> tuple[list[str], list[tuple[int, ...]]]:
    """A preset's Muon matrices (2-D and stacks, embeddings and head left out): names, shapes."""
    import shard_planner

    entries = [
        e
        for g in shard_planner.load_preset(preset).groups
        for e in g.entries
        if e.shape is not None
        and len(e.shape) in (2, 3)
        and not any(k in e.name for k in ("embed", "lm_head"))
    ]
    return [e.name for e in entries], [tuple(e.shape) for e in entries]


def _preset_plans(presets: list[str], worlds: list[int]) -> list[dict[str, Any]]:
    """LPT against round robin from shapes alone, on real models' hidden matrices."""
    from ragged_optimizers import makespan, plan_owners
    from ragged_placement._placement import chunk_range

    rows = []
    for preset in presets:
        names, shapes = _hidden_matrices(preset)
        for world in worlds:
            pieces = [
                [
                    (hi - lo) * math.prod(s[1:])
                    for lo, hi in (chunk_range(s[0], world, r) for r in range(world))
                ]
                for s in shapes
            ]
            lpt = plan_owners(names, shapes, pieces, world, 5)
            rr = _round_robin(names, shapes, pieces, world, 5)
            total = sum(a.flops for a in lpt)
            bound = max(max(a.flops for a in lpt), total / world)
            rows.append(
                {
                    "preset": preset,
                    "world": world,
                    "num_matrices": len(lpt),
                    "lpt_over_bound": makespan(lpt, world) / bound,
                    "round_robin_over_bound": makespan(rr, world) / bound,
                }
            )
    print("\nOwner plans from shapes alone (5 Newton-Schulz steps; bound = max(largest, total/W))")
    print("| preset | W | matrices | LPT makespan / bound | round robin / bound |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['preset']} | {r['world']} | {r['num_matrices']:,} | "
            f"{r['lpt_over_bound']:.3f} | {r['round_robin_over_bound']:.3f} |"
        )
    return rows


def _hsdp_plans(presets: list[str], meshes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Owner plans over replicate x shard ranks (HSDP, `replica_owners`), from shapes alone.

    Slot s holds shard rank s % W's pieces; the plan is LPT over R x W slots, as Muon makes
    it. The bound is max(largest matrix, total / (R x W)); each replica doing all of its
    matrices instead would take total / W at best.
    """
    from ragged_optimizers import makespan, plan_owners
    from ragged_placement._placement import chunk_range

    rows = []
    for preset in presets:
        names, shapes = _hidden_matrices(preset)
        for replicas, world in meshes:
            slots = replicas * world
            pieces = [
                [
                    (hi - lo) * math.prod(s[1:])
                    for lo, hi in (chunk_range(s[0], world, slot % world) for slot in range(slots))
                ]
                for s in shapes
            ]
            plan = plan_owners(names, shapes, pieces, slots, 5)
            total = sum(a.flops for a in plan)
            bound = max(max(a.flops for a in plan), total / slots)
            rows.append({"preset": preset, "replicas": replicas, "world": world,
                         "num_matrices": len(plan),
                         "lpt_over_bound": makespan(plan, slots) / bound,
                         "per_replica_over_bound": max(bound, total / world) / bound})  # fmt: skip
    print("\nHSDP owner plans over replicate x shard ranks (bound = max(largest, total/(R W)))")
    print("| preset | R x W | matrices | LPT makespan / bound | per replica, at best / bound |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['preset']} | {r['replicas']} x {r['world']} | {r['num_matrices']:,} | "
            f"{r['lpt_over_bound']:.3f} | {r['per_replica_over_bound']:.3f} |"
        )
    return rows


def _alternating_ms(
    steps: dict[Any, Any], rounds: int, sync: Any = lambda: None
) -> dict[Any, float]:
    """Median ms of each step function, the functions taking turns for `rounds` rounds."""
    times: dict[Any, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def _one_process_adamw(args: argparse.Namespace) -> dict[str, Any]:
    """AdamW8bit (native, compiled and eager) against torch's foreach AdamW: one process, one
    thread, plain matrices (half 1024 x 1024, half 1024 x 2816), fixed gradients, steps
    alternating. The "_runs" variants hold the matrices (and their gradients) as views of one
    storage, as a DBuffer's shard does: ragged_optimizers.AdamW and AdamW8bit then step each
    run of adjacent matrices (two here: one per width) as one tensor."""
    from ragged_optimizers import AdamW, AdamW8bit

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(1)
    shapes = [(1024, 1024)] * (args.adam_matrices // 2) + [(1024, 2816)] * (
        args.adam_matrices - args.adam_matrices // 2
    )
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).mul_(0.02).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(device) for s in shapes]

    def params() -> list[torch.nn.Parameter]:
        out = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(out, grads, strict=True):
            p.grad = g.clone()
        return out

    def shared_params() -> list[torch.nn.Parameter]:
        storage = torch.cat([b.reshape(-1) for b in base])
        grad_storage = torch.cat([g.reshape(-1) for g in grads])
        out, at = [], 0
        for b in base:
            param = torch.nn.Parameter(storage[at : at + b.numel()].view(b.shape))
            param.grad = grad_storage[at : at + b.numel()].view(b.shape)
            out.append(param)
            at += b.numel()
        return out

    opts: dict[str, Any] = {}
    opts["adamw8bit_runs"] = AdamW8bit(shared_params())
    opts["adamw_runs"] = AdamW(shared_params(), foreach=True)
    if not cuda:
        opts["adamw8bit_native"] = AdamW8bit(params(), fused="native")
    opts["adamw8bit_compiled"] = AdamW8bit(params(), fused="compiled")
    opts["adamw8bit_eager"] = AdamW8bit(params(), fused=False)
    opts["adamw_foreach"] = torch.optim.AdamW(params(), foreach=True)
    if cuda:
        opts["adamw_fused"] = torch.optim.AdamW(params(), fused=True)
    sync = torch.cuda.synchronize if cuda else lambda: None
    first: dict[str, float] = {}
    for name, opt in opts.items():  # the fused ones build here
        start = time.perf_counter()
        opt.step()
        sync()
        first[name] = time.perf_counter() - start
    ms = _alternating_ms({name: opt.step for name, opt in opts.items()}, args.adam_steps, sync)
    baseline = "adamw_fused" if cuda else "adamw_foreach"
    paths = {
        name: opts[name].kernel_paths[device.type] for name in opts if name.startswith("adamw8b")
    }
    result = {
        "device": device.type,
        "baseline": baseline,
        "num_params": sum(math.prod(s) for s in shapes),
        "step_ms": ms,
        "first_step_s": first,
        "compile_s": {name: path.compile_seconds for name, path in paths.items()},
        "path": {name: str(path) for name, path in paths.items()},
    }
    print(
        f"\nAdamW8bit, one process, one thread, {device.type}, {args.adam_matrices} matrices "
        f"({result['num_params'] / 1e6:.1f}M parameters), median of {args.adam_steps} steps"
    )
    print(f"| optimizer | step ms | / {baseline} | first step s |")
    print("| --- | --- | --- | --- |")
    for name in opts:
        print(f"| {name} | {ms[name]:.1f} | {ms[name] / ms[baseline]:.2f} | {first[name]:.1f} |")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return result


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops a step dispatches, views aside: on a GPU, about a launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _muon_experts(args: argparse.Namespace) -> dict[str, Any]:
    """Muon's own cost on an MoE's many small expert matrices: one process, one thread, the
    example decoder (8 blocks, dim 64, separate-Linear experts of hidden 32) at 16 and 64
    experts per block; batched Newton-Schulz (ns_batch_numel's default) against one matrix
    at a time (ns_batch_numel=1), steps alternating. Reported: the ATen ops (not views)
    a step dispatches (on a GPU each is a kernel launch, and at these sizes launches are the step)
    and the CPU step time (on CPU a bfloat16 bmm runs matrix by matrix, so batching saves
    only the Python and dispatch work)."""
    from model import Config, Decoder

    from ragged_optimizers import Muon

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    print("\nMuon on MoE expert matrices, one process, one thread")
    print(
        "| experts per block | matrices | ATen ops per step: one at a time | batched | "
        "CPU step ms: one at a time | batched |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for num_experts in (16, 64):
        torch.manual_seed(0)
        cfg = Config(vocab=1000, dim=64, num_heads=4, num_layers=8, hidden=128)
        model = Decoder(dataclasses.replace(cfg, num_experts=num_experts))
        matrices = [
            p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2
        ]
        gen = torch.Generator().manual_seed(1)
        for p in matrices:
            p.grad = torch.randn(p.shape, generator=gen)
        opts = {
            "single": Muon(matrices, lr=0.0, ns_batch_numel=1),
            "batched": Muon(matrices, lr=0.0),
        }
        ops = {}
        for b, opt in opts.items():
            opt.step()  # momentum buffers
            with _OpCounter() as counter:
                opt.step()
            ops[b] = counter.count
        ms = _alternating_ms({b: opt.step for b, opt in opts.items()}, args.muon_steps)
        out[str(num_experts)] = {"num_matrices": len(matrices), "step_ms": ms, "aten_ops": ops}
        one, many = "single", "batched"
        print(
            f"| {num_experts} | {len(matrices)} | {ops[one]} | {ops[many]} "
            f"({ops[many] / ops[one]:.2f}x) | {ms[one]:.0f} | {ms[many]:.0f} "
            f"({ms[many] / ms[one]:.2f}x) |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "optimizers.json")
    parser.add_argument("--plans-only", action="store_true", help="only the preset plan table")
    parser.add_argument("--adam-matrices", type=int, default=24)
    parser.add_argument("--adam-steps", type=int, default=5)
    parser.add_argument("--adam-only", action="store_true", help="only the one-process AdamW")
    parser.add_argument("--device", default="cpu", help="the one-process AdamW's device")
    parser.add_argument("--muon-steps", type=int, default=5)
    parser.add_argument("--experts-only", action="store_true", help="only Muon on MoE experts")
    parser.add_argument(
        "--meshes-only",
        action="store_true",
        help="only Muon per mesh (FSDP, HSDP, dp x tp) at the even worlds >= 4",
    )
    args = parser.parse_args()
    if args.experts_only:
        _muon_experts(args)
        return
    plans = _preset_plans(["llama3-8b", "qwen3-30b-a3b", "gpt-oss-120b"], [8, 64, 256])
    hsdp = _hsdp_plans(["gpt-oss-120b", "deepseek-v3-671b"], [(8, 128)])
    if args.plans_only:
        return
    one_process: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    if not args.meshes_only:
        one_process = _one_process_adamw(args)
        if args.adam_only:
            return
        experts = _muon_experts(args)
    ctx = mp.get_context("spawn")
    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        if args.meshes_only and (world < 4 or world % 2):
            continue
        queue = ctx.Queue()
        init = f"file://{tempfile.mkdtemp()}/rendezvous"
        procs = [
            ctx.Process(target=_rank, args=(rank, world, init, args, queue))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        result = queue.get(timeout=1800)
        for proc in procs:
            proc.join()
        results.append(result)
        if not args.meshes_only:
            _print(result, args)
        _print_meshes(result, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "steps": results,
                "preset_plans": plans,
                "hsdp_plans": hsdp,
                "adamw_one_process": one_process,
                "muon_experts": experts,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


def _print_meshes(r: dict[str, Any], args: argparse.Namespace) -> None:
    if not r["meshes"]:
        return
    w = r["world"]
    names = {"fsdp": f"FSDP {w}", "hsdp": f"HSDP 2 x {w // 2}", "tp": f"(dp, tp) = ({w // 2}, 2)"}
    print(
        f"\nMuon per mesh, W={w}: this version against each mesh's previous path and the "
        f"redundant baseline (median of {args.steps * args.rounds} steps, slowest rank; "
        f"busiest rank's Newton-Schulz GFLOP counted in one step)"
    )
    print("| mesh | variant | step ms | / before | / redundant | busiest NS GFLOP | / before |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in r["meshes"]:
        ms, flops = row["ms"], row["busiest_ns_gflop"]
        for name in ms:
            label = row["before"] if name == "before" else name
            redundant = f"{ms[name] / ms['redundant']:.3f}" if "redundant" in ms else "-"
            print(
                f"| {names[row['layout']]} | {label} | {ms[name]:.0f} | "
                f"{ms[name] / ms['before']:.3f} | {redundant} | {flops[name]:.2f} | "
                f"{flops[name] / flops['before']:.3f} |"
            )
        print(f"|  | plan: {row['plan']} |  |  |  |  |  |")
    for row in r["meshes"]:
        for name, t in row["overlap"].items():
            print(
                f"{names[row['layout']]}, {name}: {t['buckets']:.0f} bucket(s); the busiest "
                f"rank waited {t['wait_s'] * 1e3:.0f} ms for pieces and orthogonalized for "
                f"{t['orthogonalize_s'] * 1e3:.0f} ms (host time, last step)"
            )


def _print(r: dict[str, Any], args: argparse.Namespace) -> None:
    w, ms, span = r["world"], r["muon_ms"], r["makespan_gflop"]
    print(
        f"\nW={w}: {r['num_params'] / 1e6:.1f}M parameters, {r['num_matrices']} Muon matrices, "
        f"median of {args.steps * args.rounds} steps, slowest rank"
    )
    print("| Muon owners | step ms | / redundant | NS makespan GFLOP | sent MB / step (max rank) |")
    print("| --- | --- | --- | --- | --- |")
    spans = {"lpt": span["lpt"], "round_robin": span["round_robin"], "redundant": span["total"]}
    for name in ("lpt", "round_robin", "redundant"):
        print(
            f"| {name} | {ms[name]:.0f} | {ms[name] / ms['redundant']:.3f} | {spans[name]:.1f} | "
            f"{r['sent_mb_per_step'][name]:.1f} |"
        )
    print(f"LPT makespan / round robin: {span['lpt'] / span['round_robin']:.3f}")
    a, s = r["adam_ms"], r["state_bytes"]
    print(
        f"AdamW (ragged_optimizers, per run): step {a['adamw_flat']:.0f} ms vs torch AdamW "
        f"foreach {a['adamw_foreach']:.0f} ms ({a['adamw_flat'] / a['adamw_foreach']:.2f}x)"
    )
    print(
        f"AdamW8bit: step {a['adamw8bit']:.0f} ms vs torch AdamW foreach "
        f"{a['adamw_foreach']:.0f} ms "
        f"({a['adamw8bit'] / a['adamw_foreach']:.2f}x), vs ragged_optimizers.AdamW "
        f"({a['adamw8bit'] / a['adamw_flat']:.2f}x); state {s['adamw8bit'] / 1e6:.1f} MB vs "
        f"{s['adamw_foreach'] / 1e6:.1f} MB ({s['adamw8bit'] / s['adamw_foreach']:.4f}x, "
        f"{s['adamw8bit'] / r['num_params']:.4f} bytes per parameter)"
    )


if __name__ == "__main__":
    main()
