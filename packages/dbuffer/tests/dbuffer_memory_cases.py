"""DBuffer's memory: freed views raise, frees wait for the current stream, no copies beyond
the planned ones, and backward after a reshard.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from dbuffer_support import DTYPES, make_tensors
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer


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
    buf = DBuffer(make_tensors(dist.get_world_size(), "fp32", seed=9), mesh)
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
    tensors = dict(make_tensors(world, "fp32", seed=6))
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
    tensors = dict(make_tensors(world, "fp32", seed=6))
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


def check_zero_copy(mixed: bool, host: bool = False) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile, record_function

    from dbuffer import HostShard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    kept = HostShard() if host else None
    buf = DBuffer(make_tensors(world, "fp32", seed=5), mesh, host_shard=kept)
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
