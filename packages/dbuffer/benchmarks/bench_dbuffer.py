"""DBuffer against FSDP2's copy path, side by side in one run (gloo, CPU).

Run: `nox -s bench -- dbuffer` (or `python benchmarks/bench_dbuffer.py [--world-sizes 2,4]`).

For one FSDP group, per step: unshard (all-gather) then reduce-scatter of the gradients.
- FSDP2 path, built from torch's own FSDP2 ops: copy-in (`fsdp.all_gather_copy_in`) of every
  parameter's padded Shard(0) piece, all-gather, copy-out (`fsdp.split_with_sizes_copy`) into
  per-parameter unsharded tensors; then copy-in of the gradients (`fsdp.chunk_cat`) and
  reduce-scatter.
- DBuffer: all-gather straight into the global buffer whose views are the parameters; one
  copy of each gradient into the global gradient buffer (`accumulate_grad`), reduce-scatter
  straight from it.
Groups: a Llama-style block (hidden 2048, MLP 5632: 46M parameters) and an MoE block (hidden
1024, 64 experts of 256 x 1024 x 3: 54M parameters). Prints the median step time of the
slowest rank for both, their ratio (target: <= 0.95 dense, <= 0.85 MoE), the bytes each path
copies per step outside the collectives, and the bytes each rank puts into the all-gather.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _groups() -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    h, inter = 2048, 5632
    dense = [
        ("q", (h, h)),
        ("k", (h // 4, h)),
        ("v", (h // 4, h)),
        ("o", (h, h)),
        ("gate", (inter, h)),
        ("up", (inter, h)),
        ("down", (h, inter)),
        ("norm1", (h,)),
        ("norm2", (h,)),
    ]
    e, eh, ei = 64, 1024, 256
    moe = [("q", (eh, eh)), ("k", (eh, eh)), ("v", (eh, eh)), ("o", (eh, eh)), ("router", (e, eh))]
    for i in range(e):
        moe += [(f"e{i}.gate", (ei, eh)), (f"e{i}.up", (ei, eh)), (f"e{i}.down", (eh, ei))]
    moe += [("norm1", (eh,)), ("norm2", (eh,))]
    return {"dense": dense, "moe": moe}


class Fsdp2Path:
    """FSDP2's per-parameter Shard(0) path with its copy-in / copy-out."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], world: int, rank: int) -> None:
        import torch.distributed.fsdp  # registers the fsdp:: ops

        self.world, self.rank = world, rank
        self.shapes = [t.shape for _, t in tensors]
        self.padded_rows = [-(-s[0] // world) for s in self.shapes]
        self.rows = [
            r * (t.numel() // t.shape[0])
            for r, (_, t) in zip(self.padded_rows, tensors, strict=True)
        ]
        self.shards = []
        for (_, t), rows in zip(tensors, self.padded_rows, strict=True):
            shard = torch.zeros(rows, *t.shape[1:])
            piece = t[rank * rows : (rank + 1) * rows]
            shard[: piece.shape[0]].copy_(piece)
            self.shards.append(shard)
        self.input_numel = sum(self.rows)
        self.unsharded = [
            torch.empty(world * rows, *s[1:])
            for rows, s in zip(self.padded_rows, self.shapes, strict=True)
        ]
        self.grads = [torch.ones_like(u) for u in self.unsharded]
        self.copied = 0

    def step(self) -> None:
        output = torch.empty(self.input_numel * self.world)
        inputs = [s.reshape(-1) for s in self.shards]
        ag_input, ag_output = torch.ops.fsdp.all_gather_copy_in(
            inputs, output, self.rows, self.input_numel, self.rank
        )
        dist.all_gather_single(ag_output, ag_input)
        outs = [u.view(self.world, -1) for u in self.unsharded]
        torch.ops.fsdp.split_with_sizes_copy(
            ag_output.view(self.world, -1), self.rows, dim=1, out=outs
        )
        rs_input = torch.empty(self.world * self.input_numel)
        torch.ops.fsdp.chunk_cat(self.grads, 0, self.world, out=rs_input.view(self.world, -1))
        rs_output = torch.empty(self.input_numel)
        dist.reduce_scatter_single(rs_output, rs_input, op=dist.ReduceOp.SUM)
        # Bytes copied outside the collectives: copy-in, copy-out, gradient copy-in.
        self.copied = 4 * (self.input_numel + self.world * self.input_numel * 2)


def _measure(
    label: str, shapes: list[tuple[str, tuple[int, ...]]], mesh: object, repeats: int
) -> str:
    from dbuffer import DBuffer

    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    tensors = [(name, torch.randn(shape, generator=gen)) for name, shape in shapes]
    numel = sum(t.numel() for _, t in tensors)
    buf = DBuffer(tensors, mesh)  # type: ignore[arg-type]
    fsdp2 = Fsdp2Path(tensors, world, rank)

    grads = {name: torch.ones_like(t) for name, t in tensors}

    def ours() -> float:
        # Both paths start from the gradients autograd made: FSDP2 copies them in with
        # chunk_cat, we with one accumulate_grad copy each into the gradient buffer (timed and
        # counted; an engine that hands autograd the buffer's views would skip it).
        start = time.perf_counter()
        buf.unshard().wait()
        for name, grad in grads.items():
            buf.accumulate_grad(name, grad)
        buf.reduce_scatter(op="sum").wait()
        buf.reshard()
        return time.perf_counter() - start

    def theirs() -> float:
        start = time.perf_counter()
        fsdp2.step()
        return time.perf_counter() - start

    ours()
    theirs()  # warm up both
    ours_t: list[float] = []
    fsdp2_t: list[float] = []
    for _ in range(repeats):  # alternate so that noise hits both alike
        for fn, times in ((ours, ours_t), (theirs, fsdp2_t)):
            dist.barrier()
            times.append(fn())
    medians = [statistics.median(ours_t), statistics.median(fsdp2_t)]
    stats = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    o, f = stats.tolist()
    ours_wire = buf.shard_size * 4 * (world - 1) / 1e6
    fsdp2_wire = fsdp2.input_numel * 4 * (world - 1) / 1e6
    times = f"{o * 1e3:>9.1f} {f * 1e3:>10.1f} {o / f:>7.3f}"
    # The gradient copy, and on gloo this rank's shard out of the in-place all-reduce (gloo's
    # reduce-scatter, which FSDP2 calls, clones the whole input inside the collective
    # instead: not counted here). The parameters are gathered in place.
    ours_copied = 4 * (numel + buf.shard_size)
    volumes = (
        f"{ours_copied / 1e6:>11.1f}M {fsdp2.copied / 1e6:>11.1f}M "
        f"{ours_wire:>9.1f}M {fsdp2_wire:>9.1f}M"
    )
    return f"{label:<6} {world:>5} {numel / 1e6:>7.1f}M {times} {volumes}"


def _rank(rank: int, world: int, init_file: str, repeats: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import ragged_placement  # noqa: F401  (installs RaggedShard into DTensor first)

    mesh = init_device_mesh("cpu", (world,))
    lines = [_measure(label, shapes, mesh, repeats) for label, shapes in _groups().items()]
    if rank == 0:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown, which can abort after gloo work (see tests)


def guard_cost(calls: int = 1000) -> str:
    """Microseconds the freed-memory guard adds per op that takes a view, forward and backward.

    One linear layer (x: 8 x 256, weight 256 x 256, as in a small model's projection), run
    on a guarded view of the weight and on a plain alias of the same memory, alternating; the
    backward of the guarded run also goes through the saved-tensor check.
    """
    from dbuffer._views import guard

    torch.set_num_threads(1)
    weight = torch.randn(256, 256)
    plain = weight.detach().requires_grad_()
    always = types.SimpleNamespace(allocated=True)  # a buffer that is never freed
    view = guard(weight.detach(), "unsharded tensor 'w'", always).requires_grad_()
    x = torch.randn(8, 256, requires_grad=True)

    def run(w: torch.Tensor, backward: bool) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            out = torch.nn.functional.linear(x, w)
            if backward:
                out.sum().backward()
        return (time.perf_counter() - start) / calls

    rows = []
    for backward in (False, True):
        run(plain, backward), run(view, backward)  # warm up
        # Alternating runs; the fastest of each side is the least disturbed by the machine.
        pairs = [(run(plain, backward), run(view, backward)) for _ in range(9)]
        plain_s, view_s = min(p for p, _ in pairs), min(v for _, v in pairs)
        what = "forward + backward" if backward else "forward"
        rows.append(
            f"guard, linear {what}: {plain_s * 1e6:.1f} us plain, {view_s * 1e6:.1f} us guarded "
            f"(+{(view_s - plain_s) * 1e6:.1f} us per op)"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.txt")
        for world in (int(w) for w in args.world_sizes.split(",")):
            mp.start_processes(
                _rank,
                args=(world, os.path.join(tmp, f"rdzv{world}"), args.repeats, out),
                nprocs=world,
                start_method="spawn",
            )
        print("gloo, fp32; time: median step (unshard + reduce-scatter) of the slowest rank")
        print(
            f"{'group':<6} {'world':>5} {'params':>8} {'ours ms':>9} {'fsdp2 ms':>10} {'ratio':>7} "
            f"{'ours copied':>12} {'fsdp2 copied':>12} {'ours AG in':>10} {'fsdp2 AG in':>10}"
        )
        with open(out) as f:
            print(f.read(), end="")
    print(guard_cost())


if __name__ == "__main__":
    main()
