"""DBuffer checks run on every rank of a RankPool, against single-process references."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer
from ragged_placement import RaggedShard, flat_range

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _tensors(world: int, dtype: str, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (17, 8), "b1": (8,), "w2": (3 * world + 1, 5), "empty": (0, 4), "s": (1,)}
    return [(n, torch.randn(s, generator=gen).to(DTYPES[dtype])) for n, s in shapes.items()]


def check_unshard_and_views(dtype: str, block_rows: int) -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, dtype)
    buf = DBuffer(tensors, mesh, block_rows=block_rows)
    assert buf.local.numel() == buf.shard_size
    storage = buf.local.untyped_storage().data_ptr()
    for name, t in tensors:
        sharded = buf.sharded(name)
        local = sharded.to_local()
        if t.numel():
            assert isinstance(sharded.placements[0], RaggedShard)
            assert local.untyped_storage().data_ptr() == storage  # a view of `local`
            lo, hi = flat_range(sharded)
            assert torch.equal(local, t.reshape(-1)[lo:hi])
        assert torch.equal(sharded.full_tensor(), t)
    for cycle in range(2):
        buf.unshard().wait()
        views = {name: buf.full(name) for name, _ in tensors}
        for name, t in tensors:
            assert torch.equal(views[name], t), (name, cycle)
            assert buf.full(name) is views[name]  # the same object every time
        buf.reshard()
        try:
            buf.full("w1")
        except RuntimeError as exc:
            assert "unshard()" in str(exc)
        else:
            raise AssertionError("full() while resharded must raise")


def check_num_shard_dims() -> None:
    """Cutting inside an expert: (E, H, F) with 2 cuttable dims balances E < W experts."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(5)
    experts, bias = torch.randn(2, 3, 4, generator=gen), torch.randn(5, generator=gen)
    tensors = [("experts", experts), ("bias", bias)]
    whole = DBuffer(tensors, mesh, align_bytes=4)
    cut = DBuffer(tensors, mesh, num_shard_dims={"experts": 2}, align_bytes=4)
    assert whole.sharded("experts").placements[0].dims == (0,)
    assert cut.sharded("experts").placements[0].dims == (0, 1)
    # Whole experts (12 elements) bound the shard at W >= 2 to 12 (W=2: 17, an expert and the
    # bias); rows of 4 elements let 29 elements spread: 16 at W=2, 8 at W=4.
    expected = {1: (29, 29), 2: (17, 16), 3: (12, 12), 4: (12, 8)}[world]
    assert (whole.shard_size, cut.shard_size) == expected
    for buf in (whole, cut):
        assert torch.equal(buf.sharded("experts").full_tensor(), experts)
        buf.unshard().wait()
        assert torch.equal(buf.full("experts"), experts)
        buf.full_grad("experts").copy_(experts * (rank + 1))
        buf.full_grad("bias").copy_(bias)
        buf.reduce_scatter(op="sum").wait()
        scale = world * (world + 1) / 2
        torch.testing.assert_close(buf.sharded_grad("experts").full_tensor(), experts * scale)
        buf.reshard()
    a = torch.randn(4, 3)
    expect_error(
        ValueError, lambda: DBuffer([("a", a)], mesh, num_shard_dims=3), "must be an int in [1, 2]"
    )
    expect_error(ValueError, lambda: DBuffer([("a", a)], mesh, num_shard_dims={"z": 1}), "['z']")
    expect_error(
        TypeError, lambda: DBuffer([("a", a)], mesh, num_shard_dims=[2]), "num_shard_dims must be"
    )


def check_reshard_keeping_a_part(parts: int) -> None:
    """reshard(keep_group=...) keeps 1/k; the next unshard gathers over those k ranks only."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "fp32", seed=7)
    buf = DBuffer(tensors, mesh)
    start = rank // parts * parts
    keep = dist.new_group(list(range(start, start + parts)), use_local_synchronization=True)
    for dtype in (torch.float32, torch.bfloat16):
        buf.unshard(dtype=dtype).wait()
        buf.reshard(keep_group=keep)
        assert not buf.is_unsharded
        # Change the shard: a gather from the kept part does not see it (what was gathered
        # is kept as it was, as FSDP2's), a full one does. Keeping all W parts keeps nothing.
        saved = buf.local.clone()
        buf.local.add_(1.0)
        buf.unshard(dtype=dtype).wait()
        kept = parts < world
        for name, t in tensors:
            expected = t if kept else t + 1
            assert torch.equal(buf.full(name, dtype=dtype), expected.to(dtype)), (name, dtype)
        buf.reshard()
        buf.unshard(dtype=dtype).wait()
        assert torch.equal(buf.full("w1", dtype=dtype), (tensors[0][1] + 1).to(dtype))
        buf.reshard()
        buf.local.copy_(saved)
    if world % 2 == 0 and world > 2:  # two ranks that are not consecutive from this one
        other = [r for r in range(world) if r % 2 == rank % 2]
        group = dist.new_group(other, use_local_synchronization=True)
        buf.unshard().wait()
        expect_error(ValueError, lambda: buf.reshard(keep_group=group), "consecutive ranks")


def check_mixed_precision_unshard() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "fp32", seed=1)
    buf = DBuffer(tensors, mesh)
    buf.unshard(dtype=torch.bfloat16).wait()
    for name, t in tensors:
        got = buf.full(name, dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16))


def check_async_unshard_overlaps_compute() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "fp32", seed=2)
    buf = DBuffer(tensors, mesh)
    handle = buf.unshard(async_op=True)
    torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the all-gather runs
    handle.wait()
    for name, t in tensors:
        assert torch.equal(buf.full(name), t)


def check_reduce_scatter(op: str, dtype: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, dtype, seed=3)
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


def check_hsdp() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    tensors = _tensors(2, "fp32", seed=4)
    buf = DBuffer(tensors, mesh, shard_axis=1, replicate_axis=0)
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

    bf16 = DBuffer(_tensors(2, "bf16", seed=4), mesh, shard_axis=1, replicate_axis=0)
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
    tensors = dict(_tensors(world, "fp32", seed=8))
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


class _FakeStream:
    """Records the waits DBuffer issues; stands in for CUDA streams on CPU."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_for: list[str] = []

    def wait_stream(self, other: _FakeStream) -> None:
        self.waited_for.append(other.name)


def check_frees_wait_for_the_current_stream() -> None:
    """Before freeing memory allocated on another stream, that stream waits for this one."""
    import sys

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    buf = DBuffer(_tensors(dist.get_world_size(), "fp32", seed=9), mesh)
    side, main = _FakeStream("side"), _FakeStream("main")
    current = [side]
    # Every dbuffer module that asks for the current stream gets the fake one.
    modules = [m for n, m in sys.modules.items() if n.startswith("dbuffer.")]
    patched = [m for m in modules if hasattr(m, "current_stream")]
    originals = [m.current_stream for m in patched]  # type: ignore[attr-defined]
    for module in patched:
        module.current_stream = lambda device: current[0]  # type: ignore[attr-defined]
    # On one rank the unsharded buffer aliases the local shard: reshard frees nothing.
    param_waits = ["main"] if dist.get_world_size() > 1 else []
    try:
        buf.unshard().wait()  # allocated on "side"
        buf.accumulate_grad("w1", torch.ones(17, 8))  # grad buffer allocated on "side"
        current[0] = main
        buf.reshard()  # freed from "main": "side" must wait for "main" first
        assert side.waited_for == param_waits, side.waited_for
        buf.reduce_scatter().wait()
        assert side.waited_for == [*param_waits, "main"], side.waited_for
        buf.unshard().wait()  # re-allocated on "main" now
        buf.reshard()  # same stream: no wait needed
        assert main.waited_for == [] and side.waited_for == [*param_waits, "main"]
    finally:
        for module, original in zip(patched, originals, strict=True):
            module.current_stream = original  # type: ignore[attr-defined]


class _OtherTensor(torch.Tensor):
    pass


def check_freed_views_raise(how: str) -> None:
    """With freed-memory checks on (`check_freed=True`, or `DBUFFER_CHECK_FREED=1`), views of
    freed buffers raise a clear error when read and work again once re-allocated."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = dict(_tensors(world, "fp32", seed=6))
    if how == "argument":
        buf = DBuffer(list(tensors.items()), mesh, block_rows=2, check_freed=True)
    else:
        os.environ["DBUFFER_CHECK_FREED"] = "1"
        try:
            buf = DBuffer(list(tensors.items()), mesh, block_rows=2)
        finally:
            del os.environ["DBUFFER_CHECK_FREED"]
    assert buf.check_freed
    buf.unshard().wait()
    w1 = buf.full("w1")
    derived = {"t()": w1.t(), "row": w1[1], "param": torch.nn.Parameter(w1)}
    derived["param.t()"] = derived["param"].t()
    # Aliases that are not autograd views: .data (also of a Parameter) and as_subclass.
    derived["data"] = w1.data
    derived["param.data"] = derived["param"].data
    derived["as_subclass"] = w1.as_subclass(torch.Tensor)
    expected = {
        "t()": w1.t().contiguous(),
        "row": w1[1].clone(),
        "param": w1.clone(),
        "param.t()": w1.t().contiguous(),
        "data": w1.clone(),
        "param.data": w1.clone(),
        "as_subclass": w1.clone(),
    }
    # Autograd saved a view for backward (linear saves its weight to compute the input's
    # gradient); the buffer is freed before backward runs.
    x = torch.ones(3, 8, requires_grad=True)
    saved = torch.nn.functional.linear(x, derived["param"]).sum()
    buf.reshard()
    freed = "unsharded tensor 'w1' is freed"
    readers = {
        "add": lambda: w1 + 1,
        "sum": lambda: w1.sum(),
        "matmul": lambda: w1 @ torch.ones(8, 2),
        "repr": lambda: repr(w1),
        "in-place": lambda: w1.add_(1),
        "linear": lambda: torch.nn.functional.linear(torch.ones(1, 8), derived["param"]),
        "t()": lambda: derived["t()"].sum(),
        "row": lambda: derived["row"] * 2,
        "param.t()": lambda: derived["param.t()"].sum(),
        "foreach": lambda: torch._foreach_mul([w1, buf.full_grad("w1")], 2.0),
        "data": lambda: derived["data"].sum(),
        "param.data": lambda: derived["param.data"].sum(),
        "as_subclass": lambda: derived["as_subclass"].sum(),
        ".data now": lambda: w1.data.sum(),
        "as_subclass now": lambda: w1.as_subclass(torch.Tensor).sum(),
        "backward": lambda: saved.backward(),
    }
    for read in readers.values():
        expect_error(RuntimeError, read, freed)
    expect_error(TypeError, lambda: w1.as_subclass(_OtherTensor), "escape the guard")
    # Metadata stays readable while freed; the empty tensor has nothing to free.
    assert w1.shape == tensors["w1"].shape and w1.dtype == torch.float32 and w1.grad is None
    assert w1.numel() == tensors["w1"].numel() and w1.stride() == (8, 1)
    buf.unshard().wait()
    assert torch.equal(w1, tensors["w1"])
    for what, tensor in derived.items():
        assert torch.equal(tensor, expected[what]), what
    # The full gradient buffer is released by reduce_scatter and comes back zeroed.
    grad = buf.full_grad("w1")
    grad.fill_(1.0)
    buf.reduce_scatter(op="sum").wait()
    expect_error(RuntimeError, lambda: grad.sum(), "full gradient 'w1' is freed")
    assert buf.full_grad("w1") is grad and not grad.any()


def check_freed_by_default() -> None:
    """Without the checks (the default) views are plain tensors, and what stays checked is
    `full()` and autograd's saved views: a backward that needs a freed view raises autograd's
    version error (not a crash), and works once the memory is back."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = dict(_tensors(world, "fp32", seed=6))
    assert "DBUFFER_CHECK_FREED" not in os.environ
    buf = DBuffer(list(tensors.items()), mesh, block_rows=2)
    assert not buf.check_freed
    expect_error(TypeError, lambda: DBuffer(list(tensors.items()), mesh, check_freed=1), "bool")
    buf.unshard().wait()
    w1 = buf.full("w1")
    assert type(w1) is torch.Tensor and type(buf.full_grad("w1")) is torch.Tensor
    weight = torch.nn.Parameter(w1)
    x = torch.ones(3, 8, requires_grad=True)
    loss = torch.nn.functional.linear(x, weight).square().sum()
    buf.reshard()
    expect_error(RuntimeError, lambda: buf.full("w1"), "call unshard()")
    expect_error(RuntimeError, lambda: loss.backward(retain_graph=True), "inplace operation")
    # Gathered again (as the engine does before a group's backward): the saved view is valid.
    buf.unshard().wait()
    loss.backward()
    reference = torch.nn.Parameter(tensors["w1"].clone())
    x_ref = torch.ones(3, 8, requires_grad=True)
    torch.nn.functional.linear(x_ref, reference).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, reference.grad)
    # Frees and re-allocations of many steps leave the version where autograd saw it.
    for _ in range(3):
        buf.reshard()
        buf.unshard().wait()
    again = torch.nn.functional.linear(x, weight).sum()
    buf.reshard()
    buf.unshard().wait()
    again.backward()


def check_async_handles() -> None:
    """Async reduce-scatter in a reduce dtype; reshard / full_grad wait for work in flight."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "bf16", seed=7)
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


def check_bad_input() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    a = torch.randn(4, 3)
    expect_error(ValueError, lambda: DBuffer([("a", a.t())], mesh), "must be contiguous")
    expect_error(ValueError, lambda: DBuffer([("a", a), ("b", a.double())], mesh), "one dtype")
    expect_error(ValueError, lambda: DBuffer([("a", a), ("a", a)], mesh), "unique")
    meta = torch.empty(2, device="meta")
    expect_error(ValueError, lambda: DBuffer([("a", a), ("m", meta)], mesh), "one device")
    expect_error(ValueError, lambda: DBuffer([], mesh), "at least one")
    expect_error(ValueError, lambda: DBuffer([("a", a)], mesh, shard_axis=1), "mesh axis")
    # The former names (mesh axes called dims) still work, with a DeprecationWarning.
    with pytest.warns(DeprecationWarning, match="use shard_axis"):
        old = DBuffer([("a", a)], mesh, shard_dim=0)
    with pytest.warns(DeprecationWarning, match="use shard_axis"):
        assert old.shard_dim == old.shard_axis == 0
    expect_error(
        ValueError, lambda: DBuffer([("a", a)], mesh, shard_dim=0, shard_axis=0), "not both"
    )
    expect_error(ValueError, lambda: DBuffer([("a", a)], mesh, block_rows={"z": 2}), "['z']")
    expect_error(TypeError, lambda: DBuffer([("a", a)], mesh, block_rows=[2]), "block_rows must be")
    expect_error(ValueError, lambda: DBuffer([("a", a)], mesh, align_bytes=6), "align_bytes")
    buf = DBuffer([("a", a)], mesh)
    expect_error(TypeError, lambda: buf.unshard(dtype="bf16"), "torch.dtype")
    expect_error(KeyError, lambda: buf.full("nope"), "no tensor named 'nope'")
    expect_error(RuntimeError, lambda: buf.full("a"), "call unshard()")
    expect_error(ValueError, lambda: buf.reduce_scatter(op="max"), "op must be one of")  # type: ignore[arg-type]
    expect_error(RuntimeError, lambda: buf.reduce_scatter(), "write into full_grad")
    buf.full_grad("a").fill_(1.0)
    expect_error(ValueError, lambda: buf.reduce_scatter(divide_factor=0), "divide_factor")
    expect_error(ValueError, lambda: buf.reduce_scatter(divide_factor="2"), "divide_factor")  # type: ignore[arg-type]
    expect_error(TypeError, lambda: buf.reduce_scatter(reduce_dtype="fp32"), "torch.dtype")  # type: ignore[arg-type]
    other = DBuffer([("x", torch.randn(5))], mesh)
    expect_error(
        ValueError, lambda: DBuffer([("a", a)], mesh, layout=other.layout), "does not match"
    )


_COPY_OPS = {
    "aten::copy_",
    "aten::cat",
    "aten::split_with_sizes_copy",
    "aten::_chunk_cat",
    "aten::clone",
    "aten::_to_copy",
    "aten::index_put_",
    "aten::index_copy_",
    "aten::scatter_",
    "aten::index_select",
}
_ALLOC_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::zeros",
    "aten::empty_like",
    "aten::zeros_like",
}


def _ours(prof: object, marker: str) -> list[object]:
    """Events inside `marker` that are not part of a collective (backends copy internally)."""
    picked = []
    for event in prof.events():  # type: ignore[attr-defined]
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        backend = ("c10d::", "gloo:", "nccl:", "DBuffer::")  # inside a collective or its wait
        if marker in chain and not any(n.startswith(backend) for n in chain):
            picked.append(event)
    return picked


def _within(event: object, marker: str) -> bool:
    parent = event.cpu_parent  # type: ignore[attr-defined]
    while parent is not None:
        if parent.name == marker:
            return True
        parent = parent.cpu_parent
    return False


def check_zero_copy(mixed: bool) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile, record_function

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    buf = DBuffer(_tensors(world, "fp32", seed=5), mesh)
    dtype = torch.bfloat16 if mixed else None
    buf.unshard(dtype=dtype).wait()
    for name in buf.names:
        buf.full_grad(name).fill_(1.0)
    global_storage = buf.full("w1", dtype=dtype).untyped_storage()  # the global buffer's
    buf.reshard()
    before = global_storage.size()
    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True
    ) as prof:
        with record_function("unshard"):
            buf.unshard(dtype=dtype).wait()
        with record_function("reduce_scatter"):
            buf.reduce_scatter().wait()
    unshard, reduce = _ours(prof, "unshard"), _ours(prof, "reduce_scatter")
    copies = [f"{e.name}{e.input_shapes}" for e in unshard if e.name in _COPY_OPS]
    reduce_copies = [e.input_shapes for e in reduce if e.name in _COPY_OPS]
    # Inside the collective too: gloo's own reduce-scatter clones its whole input.
    clones = [e for e in prof.events() if e.name == "aten::clone" and _within(e, "reduce_scatter")]
    allocating_ops = [f"{e.name}{e.input_shapes}" for e in unshard if e.name in _ALLOC_OPS]
    # Every thread's allocations while the unshard runs, gloo's workers' included (its
    # all-gather would stage the whole output in a temporary).
    events = list(prof.profiler.kineto_results.events())
    (window,) = [e for e in events if e.name() == "unshard"]
    begin, end = window.start_ns(), window.start_ns() + window.duration_ns()
    unshard_allocated = sum(
        e.nbytes()
        for e in events
        if e.name() == "[memory]" and begin <= e.start_ns() <= end and e.nbytes() > 0
    )
    # Views point into the buffers: one storage of exactly the global buffer's size.
    storage = global_storage.data_ptr()
    nbytes = buf.layout.buffer_numel * (dtype or torch.float32).itemsize
    assert global_storage.nbytes() == nbytes
    assert all(buf.full(n, dtype=dtype).untyped_storage().data_ptr() == storage for n in buf.names)
    assert all(
        buf.sharded_grad(n).to_local().untyped_storage().data_ptr()
        == buf.local_grad.untyped_storage().data_ptr()
        for n in buf.names
    )
    return {
        "copies": copies,
        "reduce_copies": reduce_copies,
        "reduce_clones": len(clones),
        "shard_size": buf.shard_size,
        "allocating_ops": allocating_ops,
        "unshard_allocated": unshard_allocated,
        # The one allocation of an unshard: the global storage growing back (no op allocates).
        "storage_bytes": [before, global_storage.size()],
        "buffer_bytes": nbytes,
    }


def check_training_matches_single_process(optimizer: str, mode: str = "fp32") -> None:
    """DBuffer composed by hand into FSDP training equals full-batch single-process training.

    Per step: unshard, forward/backward with persistent nn.Parameters over the full views,
    accumulate_grad, reshard, reduce_scatter(avg) (+ all_reduce(avg) for HSDP), the optimizer
    on the RaggedShard params (in place on `local`), zero_grad. Each rank trains on its own
    slice of the batch. `mode`: "fp32", "bf16" (unshard and compute in bf16, gradients
    accumulated and reduced in fp32), or "hsdp" (a 2 x 2 mesh, sharded on axis 1).
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
    buf = DBuffer(tensors, mesh, block_rows=2, **axes)
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
        opt.step()
        buf.zero_grad()
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if compute else {}
    for name, ref_param in reference.named_parameters():
        torch.testing.assert_close(sharded[name].full_tensor(), ref_param.detach(), **tolerance)
    # The optimizer wrote into the buffer itself: the next unshard gathers it.
    buf.unshard().wait()
    for name, ref_param in reference.named_parameters():
        torch.testing.assert_close(buf.full(name), ref_param.detach(), **tolerance)


def check_unshard_is_a_noop_while_unsharded() -> None:
    """A second unshard() gathers nothing (FSDP2's semantics); after reshard() it gathers."""
    from ragged_placement import CommCounter

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "fp32", seed=11)
    buf = DBuffer(tensors, mesh)
    buf.unshard().wait()
    buf.local.add_(1.0)  # e.g. an optimizer step while unsharded
    with CommCounter() as counter:
        buf.unshard().wait()
    assert counter.bytes_received == 0, counter
    for name, t in tensors:
        # Not re-gathered; on one rank the unsharded buffer is the local shard itself.
        assert torch.equal(buf.full(name), t + 1 if world == 1 else t), name
    if world == 1:
        local = buf.local.untyped_storage()
        assert all(buf.full(n).untyped_storage().data_ptr() == local.data_ptr() for n, _ in tensors)
        mixed = buf.unshard(dtype=torch.bfloat16)  # a cast needs its own buffer
        assert buf.full(tensors[0][0], dtype=torch.bfloat16).data_ptr() != local.data_ptr()
        mixed.wait()
    buf.reshard()
    expect_error(RuntimeError, lambda: buf.full(tensors[0][0]), "DBuffer is resharded")
    with CommCounter() as counter:
        buf.unshard().wait()
    if world > 1:
        assert counter.bytes_received > 0, counter
    for name, t in tensors:
        assert torch.equal(buf.full(name), t + 1), name


def check_backward_after_reshard_and_unshard(prefetch: bool, dtype: str) -> None:
    """Forward saves the full views; reshard; unshard again; backward is correct.

    The unshard after the reshard writes the views' memory through an alias with its own
    version counter, so autograd does not see an in-place change of what forward saved.
    `prefetch`: the second unshard is issued asynchronously before backward starts.
    """
    from torch import nn

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    compute = DTYPES[dtype]
    gen = torch.Generator().manual_seed(12)
    w1, w2 = torch.randn(7, 5, generator=gen), torch.randn(3, 7, generator=gen)
    x = torch.randn(4, 5, generator=gen)
    buf = DBuffer([("w1", w1), ("w2", w2)], mesh)
    buf.unshard(dtype=compute).wait()
    params = {n: nn.Parameter(buf.full(n, dtype=compute)) for n in ("w1", "w2")}
    versions = {n: p._version for n, p in params.items()}
    loss = (torch.tanh(x.to(compute) @ params["w1"].t()) @ params["w2"].t()).float().sum()
    buf.reshard()
    handle = buf.unshard(dtype=compute, async_op=prefetch)
    handle.wait()
    assert {n: p._version for n, p in params.items()} == versions
    loss.backward()
    ref = {n: t.to(compute).requires_grad_() for n, t in (("w1", w1), ("w2", w2))}
    (torch.tanh(x.to(compute) @ ref["w1"].t()) @ ref["w2"].t()).float().sum().backward()
    for name, param in params.items():
        assert param.grad is not None
        torch.testing.assert_close(param.grad, ref[name].grad, msg=f"rank {rank} {name}")
    # Writing into the views directly is still seen by autograd (only the buffer's own
    # gathers are exempt).
    loss = (params["w1"] * params["w1"]).float().sum()
    with torch.no_grad():
        params["w1"].mul_(2.0)
    expect_error(RuntimeError, loss.backward, "modified by an inplace operation")


def check_reduce_scatter_accumulate() -> None:
    """accumulate=True adds each reduce to local_grad (sharded gradient accumulation)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "fp32", seed=13)
    buf = DBuffer(tensors, mesh)
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


def check_apply_moves_storage() -> None:
    """apply_(fn) re-homes the shard (meta -> cpu with to_empty semantics, then a dtype)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = {"w": (3 * world + 2, 5), "b": (5,)}
    buf = DBuffer([(n, torch.empty(s, device="meta")) for n, s in shapes.items()], mesh)
    assert buf.local.is_meta and buf.sharded("w").to_local().is_meta
    buf.apply_(lambda t: torch.empty_like(t, device="cpu"))
    assert buf.device == torch.device("cpu") and not buf.local.is_meta
    full = {
        n: torch.randn(s, generator=torch.Generator().manual_seed(14)) for n, s in shapes.items()
    }
    buf.copy_(full)
    local = buf.sharded("w").to_local()
    assert local.untyped_storage().data_ptr() == buf.local.untyped_storage().data_ptr()
    buf.unshard().wait()
    for name, t in full.items():
        assert torch.equal(buf.full(name), t)
    expect_error(RuntimeError, lambda: buf.apply_(lambda t: t.double()), "reshard() first")
    buf.reshard()
    buf.apply_(lambda t: t.double())
    assert buf.dtype == torch.float64
    assert torch.equal(buf.sharded("w").full_tensor(), full["w"].double())
    expect_error(ValueError, lambda: buf.apply_(lambda t: t[:0]), "must return a tensor")


# -- docstring examples ------------------------------------------------------------------------


def _doctest_globs() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w, b = torch.randn(64, 16), torch.randn(16)
    return {
        "torch": torch,
        "mesh": mesh,
        "w": w,
        "b": b,
        "grad_w": torch.ones_like(w),
        "grad_b": torch.full_like(b, 2.0),
        "buf": DBuffer([("w", w), ("b", b)], mesh, block_rows={"w": 32}),
    }


def check_doctests() -> dict[str, Any]:
    from doctest_support import run_doctests

    return run_doctests("dbuffer", _doctest_globs)


def check_release_grad() -> None:
    """release_grad() returns the shard; views handed out keep their memory and values."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors(world, "fp32", seed=13)
    buf = DBuffer(tensors, mesh)
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


def check_dtensor_entries(shape: tuple[int, int]) -> None:
    """DTensors sharded over another axis (tp): the DBuffer shards their local pieces over dp.

    Every sharded view is a DTensor over (dp, tp) whose full tensor is the global one;
    unshard gathers the local piece; reduce-scatter averages the pieces' gradients over dp.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    gen = torch.Generator().manual_seed(9)
    full = {
        "col": torch.randn(12, 5, generator=gen),  # Shard(0) on tp: rows split
        "row": torch.randn(7, 12, generator=gen),  # Shard(1) on tp: columns split
        "norm": torch.randn(12, generator=gen),  # Replicate on tp
        "plain": torch.randn(3, 4, generator=gen),  # not a DTensor: over dp alone
    }
    placements = {"col": [Shard(0)], "row": [Shard(1)], "norm": [Replicate()]}
    tensors: list[tuple[str, torch.Tensor]] = [
        (name, distribute_tensor(t, tp, placements[name]) if name in placements else t)
        for name, t in full.items()
    ]
    buf = DBuffer(tensors, dp, block_rows={"col": 2})
    for name, t in full.items():
        sharded = buf.sharded(name)
        assert torch.equal(sharded.full_tensor(), t), name
        if name in placements:
            assert sharded.device_mesh.mesh_dim_names == ("dp", "tp"), name
            assert tuple(sharded.placements[1:]) == tuple(placements[name]), name
            assert isinstance(sharded.placements[0], RaggedShard) or t.numel() == 0
        else:
            assert sharded.device_mesh.mesh_dim_names == ("dp",), name
    # Rows of "col" (6 per tp rank): pieces keep blocks of 2 rows of the local piece.
    lo, hi = flat_range(buf.sharded("col"))
    assert lo % 10 == 0 and hi % 10 == 0, (lo, hi)
    buf.unshard().wait()
    local = dict(tensors)
    for name in full:
        piece = local[name].to_local() if name in placements else local[name]  # type: ignore[attr-defined]
        assert torch.equal(buf.full(name), piece), name
    buf.reshard()
    # Gradients of the local pieces, different on every rank: averaged over dp only.
    dp_rank, tp_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
    for name in full:
        buf.full_grad(name).fill_(float(dp_rank + 1) * (tp_rank + 1))
    buf.reduce_scatter(op="avg").wait()
    mean_over_dp = (shape[0] + 1) / 2
    for name in full:
        grad = buf.sharded_grad(name)
        expected = torch.full_like(grad.to_local(), mean_over_dp * (tp_rank + 1))
        assert torch.equal(grad.to_local(), expected), name
        assert grad.placements == buf.sharded(name).placements, name


def check_dtensor_entry_errors() -> None:
    """Bad DTensor entries: each error names the tensor and what would be valid."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    uneven = distribute_tensor(torch.zeros(5, 3), tp, [Shard(0)])
    expect_error(ValueError, lambda: DBuffer([("u", uneven)], dp), "uneven pieces")
    partial = DTensor.from_local(torch.zeros(4, 3), tp, [Partial()])
    expect_error(ValueError, lambda: DBuffer([("p", partial)], dp), "Partial")
    even = distribute_tensor(torch.zeros(6, 3), tp, [Shard(0)])
    expect_error(ValueError, lambda: DBuffer([("e", even)], tp), "not disjoint axes")
    unnamed = init_device_mesh("cpu", (world,))
    expect_error(ValueError, lambda: DBuffer([("e", even)], unnamed), "named axes")
    expect_error(ValueError, lambda: DBuffer([("e", even)], dp, block_rows=2), "valid: [1, 3]")
    DBuffer([("e", even)], dp, block_rows=3)  # divides the 3 local rows: fine


def check_comm_kinds() -> None:
    """Every comm kind gathers and reduce-scatters like the full-tensor reference, in place too.

    `comm_for` picks the gloo-in-place kind on CPU gloo (one rank: the one-rank kind); the
    native kind runs here too, over gloo's own single-tensor collectives.
    """
    from dbuffer._comm import GlooInPlaceComm, NativeComm, OneRankComm, comm_for

    world, rank = dist.get_world_size(), dist.get_rank()
    group, cpu = dist.group.WORLD, torch.device("cpu")
    assert group is not None
    chosen = comm_for(group, cpu)
    assert type(chosen) is (OneRankComm if world == 1 else GlooInPlaceComm), type(chosen)
    kinds = [type(chosen)] + ([NativeComm] if world > 1 else [])
    for kind in kinds:
        comm = kind(group, cpu)
        for size in (0, 5):  # an empty shard too
            # The full tensor: rank r's shard holds 100 r + (0 .. size-1).
            full = torch.cat(
                [torch.arange(size, dtype=torch.float32) + 100 * r for r in range(world)]
            )
            mine = full[rank * size : (rank + 1) * size].clone()
            output = torch.full((world * size,), -1.0)
            comm.all_gather(output, mine, async_op=False)
            assert torch.equal(output, full), (kind.__name__, output)
            output = torch.full((world * size,), -1.0)
            comm.chunk(output).copy_(mine)  # gathering in place
            comm.all_gather(output, comm.chunk(output), async_op=False)
            assert torch.equal(output, full), (kind.__name__, output)
            # Reduce: rank r sends (r + 1) * full; this rank gets its chunk of the sum.
            send = full * (rank + 1)
            out = None if comm.reduces_in_place else torch.full((size,), -1.0)
            works, result = comm.reduce_scatter(out, send, op="sum", async_op=True)
            for work in works:
                if work is not None:
                    work.wait()
            expected = full[rank * size : (rank + 1) * size] * (world * (world + 1) // 2)
            assert torch.equal(result, expected), (kind.__name__, result, expected)
            assert out is None or result is out
