"""DBuffer's gradients against single-process references: reduce-scatter, HSDP, accumulation,
async handles, releasing the shard, and training by hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dbuffer_support import make_tensors
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, HostShard


def _host(host: bool) -> dict[str, HostShard]:
    """DBuffer's keyword for a shard kept in host memory (CPU offload), or none."""
    return {"host_shard": HostShard()} if host else {}


def check_reduce_scatter(op: str, dtype: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, dtype, seed=3)
    buf = DBuffer(tensors, mesh, block_rows=2)
    grads = {
        name: torch.full(t.shape, float(rank + 1)).to(t.dtype) * (i + 1)
        for i, (name, t) in enumerate(tensors)
    }
    for name, g in grads.items():
        buf.full_grad(name).copy_(g)
    buf.reduce_scatter(op=op).wait()
    scale = world * (world + 1) / 2 / (world if op == "avg" else 1)
    for i, (name, t) in enumerate(tensors):
        expected = torch.full(t.shape, scale * (i + 1)).to(t.dtype)
        got = buf.sharded_grad(name).full_tensor()
        torch.testing.assert_close(got, expected)
    buf.zero_grad()
    assert not buf.local_grad.any()


def check_hsdp(host: bool = False) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    tensors = make_tensors(2, "fp32", seed=4)
    buf = DBuffer(tensors, mesh, shard_axis=1, replicate_axis=0, **_host(host))
    buf.unshard().wait()
    for name, t in tensors:
        assert torch.equal(buf.full(name), t)
    for name, _ in tensors:
        buf.full_grad(name).fill_(float(rank + 1))
    buf.reduce_scatter(op="avg").wait()
    buf.all_reduce(op="avg").wait()
    for name, t in tensors:
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), torch.full(t.shape, 2.5))
    # bf16 gradients all-reduced over the replicate axis in fp32: the collective carries
    # 4-byte elements and the result lands back in the bf16 gradient.
    from ragged_placement import CommCounter

    bf16 = DBuffer(
        make_tensors(2, "bf16", seed=4), mesh, shard_axis=1, replicate_axis=0, **_host(host)
    )
    replica = mesh.get_local_rank(0)
    bf16.local_grad.fill_(1.0 if replica == 0 else 3.0)
    with CommCounter() as counter:
        bf16.all_reduce(op="avg", reduce_dtype=torch.float32).wait()
    (collective,) = counter.collectives
    assert collective.kind == "all_reduce", collective
    assert collective.bytes_sent == 4 * bf16.shard_size, (collective, bf16.shard_size)
    assert bf16.local_grad.dtype == torch.bfloat16
    assert torch.equal(bf16.local_grad, torch.full_like(bf16.local_grad, 2.0))
    expect_error(TypeError, lambda: bf16.all_reduce(reduce_dtype="fp32"), "torch.dtype")  # type: ignore[arg-type]


def check_gradient_accumulation() -> None:
    """accumulate_grad copies then adds; unwritten tensors and padding reduce as zero."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = dict(make_tensors(world, "fp32", seed=8))
    buf = DBuffer(list(tensors.items()), mesh, block_rows=4, align_bytes=64)  # some padding
    covered = torch.zeros(buf.shard_size, dtype=torch.bool)
    for name in buf.names:
        lo, hi = buf.layout.local_range(name, buf._rank)
        covered[lo:hi] = True

    def grads(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 * step + rank)
        return {n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()}

    def reference(steps: list[int], names: set[str]) -> dict[str, torch.Tensor]:
        total = {n: torch.zeros(t.shape) for n, t in tensors.items()}
        for r in range(world):
            for step in steps:
                gen = torch.Generator().manual_seed(100 * step + r)
                for n, t in tensors.items():
                    g = torch.randn(t.shape, generator=gen)
                    if n in names:
                        total[n] += g
        return total

    everything = set(tensors)
    for step_grads in (grads(1), grads(2)):  # two micro-batches: copy, then add
        for name, g in step_grads.items():
            buf.accumulate_grad(name, g)
    buf.reduce_scatter(op="sum").wait()
    for name, expected in reference([1, 2], everything).items():
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), expected)
    # The same through accumulate_grads (one foreach copy, then one foreach add), with the
    # gradients in bf16 (cast on the way in, as the engine's mixed precision does), some
    # tensors copied and some added in one call, and a name given twice (added in order).
    step_grads = [grads(1), grads(2)]
    names = list(tensors)
    buf.accumulate_grads(names[:2], [step_grads[0][n] for n in names[:2]])
    buf.accumulate_grads(
        names, [step_grads[0][n] if i >= 2 else step_grads[1][n] for i, n in enumerate(names)]
    )
    buf.accumulate_grads(
        names[2:] * 2,
        [step_grads[1][n] for n in names[2:]] + [torch.zeros(tensors[n].shape) for n in names[2:]],
    )
    buf.reduce_scatter(op="sum").wait()
    by_name = buf.sharded_grads()
    assert list(by_name) == names and all(by_name[n] is buf.sharded_grad(n) for n in names)
    for name, expected in reference([1, 2], everything).items():
        torch.testing.assert_close(by_name[name].full_tensor(), expected)
    bf16 = {n: g.to(torch.bfloat16) for n, g in grads(4).items()}
    buf.accumulate_grads(list(bf16), list(bf16.values()))
    for name, g in bf16.items():
        assert torch.equal(buf.full_grad(name), g.float())
    expect_error(ValueError, lambda: buf.accumulate_grads(["w1"], []), "1 names but 0")
    expect_error(TypeError, lambda: buf.accumulate_grads("w1", [bf16["w1"]]), "list of names")
    expect_error(KeyError, lambda: buf.accumulate_grads(["nope"], [torch.ones(1)]), "'nope'")
    expect_error(ValueError, lambda: buf.accumulate_grads(names[:1], [torch.ones(1, 2)]), "(1, 2)")
    expect_error(
        TypeError,
        lambda: buf.accumulate_grads(
            names[:1], [torch.ones(tensors[names[0]].shape, dtype=torch.int32)]
        ),
        "floating point",
    )
    buf.reduce_scatter(op="sum").wait()
    # Next step: only some tensors get a gradient (and one by hand); the freed buffer comes
    # back uninitialized, so the rest and the padding must be zeroed before the reduce.
    written = {"w1", "s"}
    step3 = grads(3)
    buf.accumulate_grad("w1", step3["w1"])
    buf.full_grad("s").add_(step3["s"])
    buf.reduce_scatter(op="sum").wait()
    for name, expected in reference([3], written).items():
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), expected)
    assert not buf.local_grad[~covered].any(), "padding must reduce to zero"
    # zero_grad() forgets what was written.
    buf.accumulate_grad("w1", step3["w1"])
    buf.zero_grad()
    buf.accumulate_grad("b1", step3["b1"])
    buf.reduce_scatter(op="sum").wait()
    for name, expected in reference([3], {"b1"}).items():
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), expected)
    expect_error(ValueError, lambda: buf.accumulate_grad("w1", torch.ones(3)), "shape (17, 8)")
    expect_error(ValueError, lambda: buf.accumulate_grad("w1", [1.0]), "got list")  # type: ignore[arg-type]
    expect_error(KeyError, lambda: buf.accumulate_grad("nope", torch.ones(1)), "'nope'")
    expect_error(ValueError, lambda: buf.copy_({"w1": torch.ones(3)}), "shape (17, 8)")
    expect_error(ValueError, lambda: buf.copy_({"w1": [1.0]}), "got <class 'list'>")  # type: ignore[dict-item]
    expect_error(TypeError, lambda: buf.copy_([("w1", step3["w1"])]), "mapping")  # type: ignore[arg-type]
    expect_error(TypeError, lambda: buf.scale_grad_("2"), "must be a number")  # type: ignore[arg-type]
    # copy_: full tensors by name, then a whole DBuffer of the same layout.
    doubled = {name: 2 * t for name, t in tensors.items()}
    buf.copy_({"w1": doubled["w1"], "b1": doubled["b1"]})
    other = DBuffer(list(tensors.items()), mesh, layout=buf.layout)
    buf.reshard()
    buf.unshard().wait()
    for name, t in tensors.items():
        assert torch.equal(buf.full(name), doubled[name] if name in ("w1", "b1") else t), name
    buf.copy_(other)
    buf.reshard()
    buf.unshard().wait()
    for name, t in tensors.items():
        assert torch.equal(buf.full(name), t), name
    expect_error(
        TypeError, lambda: buf.accumulate_grad("s", torch.ones(1, dtype=torch.int64)), "int64"
    )


def check_async_handles() -> None:
    """Async reduce-scatter in a reduce dtype; reshard / full_grad wait for work in flight."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, "bf16", seed=7)
    buf = DBuffer(tensors, mesh)
    for name in buf.names:
        buf.full_grad(name).fill_(float(rank + 1) / 4)
    assert not buf.reduce_pending
    handle = buf.reduce_scatter(op="sum", reduce_dtype=torch.float32, async_op=True)
    assert buf.reduce_pending  # the buffer owns the work in flight
    torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the reduce runs
    buf.wait_for_reduce()
    assert not buf.reduce_pending and handle.done
    handle.wait()  # idempotent
    buf.wait_for_reduce()  # nothing in flight: a no-op
    total = world * (world + 1) / 2 / 4
    for name, t in tensors:
        expected = torch.full(t.shape, total).to(torch.bfloat16)
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), expected)
    # full_grad() while a reduce-scatter is in flight waits for it: the new buffer is zero
    # and the reduced values are the ones written before.
    for name in buf.names:
        buf.full_grad(name).fill_(1.0)
    buf.reduce_scatter(op="avg", async_op=True)
    assert not buf.full_grad("w1").any()
    torch.testing.assert_close(
        buf.sharded_grad("w1").full_tensor(), torch.ones(17, 8, dtype=torch.bfloat16)
    )
    # reshard() right after an async unshard waits for it instead of freeing memory that the
    # all-gather is writing.
    for _ in range(3):
        buf.unshard(dtype=torch.float32, async_op=True)
        buf.reshard()
    buf.unshard(async_op=True).wait()
    for name, t in tensors:
        assert torch.equal(buf.full(name), t)


def check_reduce_scatter_accumulate(host: bool = False) -> None:
    """accumulate=True adds each reduce to local_grad (sharded gradient accumulation)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, "fp32", seed=13)
    buf = DBuffer(tensors, mesh, **_host(host))
    total = {name: torch.zeros(t.shape) for name, t in tensors}
    for micro in range(3):
        for name, t in tensors:
            grad = torch.full(t.shape, float(rank + 1 + micro))
            buf.accumulate_grad(name, grad)
            total[name] += sum(torch.full(t.shape, float(r + 1 + micro)) for r in range(world))
        buf.reduce_scatter(op="sum", accumulate=micro > 0, async_op=micro == 2).wait()
    for name, _ in tensors:
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), total[name])
    expect_error(TypeError, lambda: buf.reduce_scatter(accumulate=1), "accumulate must be")  # type: ignore[arg-type]


def check_release_grad(host: bool = False) -> None:
    """release_grad() returns the shard; views handed out keep their memory and values."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, "fp32", seed=13)
    buf = DBuffer(tensors, mesh, **_host(host))
    assert not buf.has_local_grad  # made on first use
    for name, t in tensors:
        buf.accumulate_grad(name, torch.full_like(t, float(rank + 1)))
    buf.reduce_scatter(op="avg").wait()
    mean = sum(range(1, world + 1)) / world
    held = buf.sharded_grad(tensors[0][0])
    buf.release_grad()
    assert not buf.has_local_grad
    assert torch.equal(held.full_tensor(), torch.full_like(tensors[0][1], mean))  # still valid
    fresh = buf.sharded_grad(tensors[0][0])
    assert fresh is not held and not fresh.to_local().any()  # a new, zeroed shard
    buf.release_grad()
    for name, t in tensors:
        buf.accumulate_grad(name, torch.ones_like(t))
    buf.reduce_scatter(op="sum").wait()  # allocates without zeroing: it writes every element
    got = buf.sharded_grad(tensors[-1][0]).full_tensor()
    assert torch.equal(got, torch.full_like(tensors[-1][1], float(world)))
    buf.zero_grad()
    buf.release_grad()
    buf.zero_grad()  # nothing allocated: nothing to zero, and nothing is made
    assert not buf.has_local_grad


def check_training_matches_single_process(
    optimizer: str, mode: str = "fp32", host: bool = False
) -> None:
    """DBuffer composed by hand into FSDP training equals full-batch single-process training.

    Per step: unshard, forward/backward with persistent nn.Parameters over the full views,
    accumulate_grad, reshard, reduce_scatter(avg) (+ all_reduce(avg) for HSDP), the optimizer
    on the RaggedShard params (in place on `local`), zero_grad. Each rank trains on its own
    slice of the batch. `mode`: "fp32", "bf16" (unshard and compute in bf16, gradients
    accumulated and reduced in fp32), or "hsdp" (a 2 x 2 mesh, sharded on axis 1). `host`:
    the shard and its gradient in host memory (CPU offload): the gathered buffer and the
    reduced gradient are then never the shards' own memory, even on one rank.
    """
    import copy

    from torch import nn
    from torch.func import functional_call

    world, rank = dist.get_world_size(), dist.get_rank()
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2))
        axes = {"shard_axis": 1, "replicate_axis": 0}
    else:
        mesh = init_device_mesh("cpu", (world,))
        axes = {}
    compute = torch.bfloat16 if mode == "bf16" else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 3))
    reference = copy.deepcopy(model)
    names = [name for name, _ in model.named_parameters()]
    tensors = [(n, p.detach()) for n, p in model.named_parameters()]
    buf = DBuffer(tensors, mesh, block_rows=2, **axes, **_host(host))  # type: ignore[arg-type]
    sharded = {name: nn.Parameter(buf.sharded(name)) for name in names}
    make_opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    }[optimizer]
    opt, ref_opt = make_opt(list(sharded.values())), make_opt(list(reference.parameters()))
    unsharded: dict[str, nn.Parameter] = {}
    gen = torch.Generator().manual_seed(1)
    per_rank = 5
    for _ in range(3):
        x = torch.randn(world * per_rank, 8, generator=gen)
        y = torch.randn(world * per_rank, 3, generator=gen)
        # Reference: the full batch in one process, in fp32.
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        # Sharded: this rank's slice.
        buf.unshard(dtype=compute).wait()
        if not unsharded:  # made once; they see each unshard's memory
            unsharded = {name: nn.Parameter(buf.full(name, dtype=compute)) for name in names}
        local = buf.local.untyped_storage().data_ptr()
        gathered = buf.full(names[0], dtype=compute).untyped_storage().data_ptr()
        assert (gathered != local) if host or world > 1 or compute else (gathered == local)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        out = functional_call(model, unsharded, (x[mine].to(compute or torch.float32),))
        nn.functional.mse_loss(out.float(), y[mine]).backward()
        buf.reshard()
        for name, param in unsharded.items():
            assert param.grad is not None
            buf.accumulate_grad(name, param.grad)  # bf16 gradients land in fp32
            param.grad = None
        buf.reduce_scatter(op="avg").wait()
        buf.all_reduce(op="avg").wait()
        for name, param in sharded.items():
            param.grad = buf.sharded_grad(name)
        if host:  # never the shard's memory: what a step moves to the device and back
            assert buf.local_grad.untyped_storage().data_ptr() != local
        opt.step()
        buf.zero_grad()
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if compute else {}
    for name, ref_param in reference.named_parameters():
        torch.testing.assert_close(sharded[name].full_tensor(), ref_param.detach(), **tolerance)
    # The optimizer wrote into the buffer itself: the next unshard gathers it.
    buf.unshard().wait()
    for name, ref_param in reference.named_parameters():
        torch.testing.assert_close(buf.full(name), ref_param.detach(), **tolerance)
