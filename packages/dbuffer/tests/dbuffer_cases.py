"""DBuffer's gather side on every rank of a RankPool, against the full tensors.

unshard / views / reshard (keeping a part too), mixed precision, async gathers, DTensor
entries, moving the storage, the comm kinds, bad input and the docstring examples.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from block_quantization import reference_block_qdq
from dbuffer_support import make_tensors
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import BlockFloat8, DBuffer
from ragged_placement import RaggedShard, flat_range


def check_unshard_and_views(dtype: str, block_rows: int) -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, dtype)
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
    tensors = make_tensors(world, "fp32", seed=7)
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
    tensors = make_tensors(world, "fp32", seed=1)
    buf = DBuffer(tensors, mesh)
    buf.unshard(dtype=torch.bfloat16).wait()
    for name, t in tensors:
        got = buf.full(name, dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16))


def check_async_unshard_overlaps_compute() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, "fp32", seed=2)
    buf = DBuffer(tensors, mesh)
    handle = buf.unshard(async_op=True)
    torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the all-gather runs
    handle.wait()
    for name, t in tensors:
        assert torch.equal(buf.full(name), t)


def check_unshard_is_a_noop_while_unsharded() -> None:
    """A second unshard() gathers nothing (FSDP2's semantics); after reshard() it gathers."""
    from ragged_placement import CommCounter

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, "fp32", seed=11)
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


def check_uneven_dtensor_entries(shape: tuple[int, int]) -> None:
    """Tensors split unevenly over tp (torch.chunk's pieces, some empty): one placement on
    every rank, the global tensor back from the shards, the local piece from unshard, the
    pieces' gradients averaged over dp."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    num_tp = shape[1]
    odd = 4 * num_tp - 1 if num_tp > 1 else 5  # 27 at tp 2 would be even at 3: keep it odd
    gen = torch.Generator().manual_seed(11)
    cases = {  # name: (global tensor, placement over tp, block_rows, num_shard_dims)
        "col": (torch.randn(odd, 9, generator=gen), Shard(0), 1, 1),  # rows split unevenly
        "row": (torch.randn(9, odd, generator=gen), Shard(1), 2, 1),  # row lengths differ
        "bias": (torch.randn(num_tp + 1, generator=gen), Shard(0), 1, 1),  # tp=4: 2,2,1,0
        "experts": (torch.randn(num_tp + 1, 3, 4, generator=gen), Shard(0), 1, 2),
    }
    placements = []
    for name, (full, placement, rows, cut) in cases.items():
        piece = distribute_tensor(full, tp, [placement])
        buf = DBuffer([(name, piece)], dp, block_rows=rows, num_shard_dims=cut)
        sharded = buf.sharded(name)
        assert torch.equal(sharded.full_tensor(), full), name
        placements.append((name, tuple(sharded.placements)))
        buf.unshard().wait()
        assert torch.equal(buf.full(name), piece.to_local()), name
        buf.reshard()
        dp_rank = mesh.get_local_rank(0)
        buf.accumulate_grad(name, torch.full_like(piece.to_local(), float(dp_rank + 1)))
        buf.reduce_scatter(op="avg").wait()
        grad = buf.sharded_grad(name)
        assert torch.equal(grad.full_tensor(), torch.full_like(full, (shape[0] + 1) / 2)), name
        # The plan's tail past a smaller piece holds nothing: zero after the reduce.
        covered = sum(t.to_local().numel() for t in buf.sharded_grads().values())
        assert buf.local_grad[covered:].count_nonzero() == 0 or covered == 0, name
        buf.copy_({name: piece.to_local() * 2})  # full tensors by name: the piece's shape
        assert torch.equal(buf.sharded(name).full_tensor(), full * 2), name
    seen: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, placements)
    assert all(other == placements for other in seen), seen  # one placement on every rank


def check_dtensor_entry_errors() -> None:
    """Bad DTensor entries: each error names the tensor and what would be valid."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    uneven = distribute_tensor(torch.zeros(5, 3), tp, [Shard(0)])
    plain = torch.zeros(2, 3)
    expect_error(ValueError, lambda: DBuffer([("u", uneven), ("p", plain)], dp), "must be alone")
    from dbuffer import BlockFloat8

    fp8 = BlockFloat8(block=(1, 3))
    expect_error(ValueError, lambda: DBuffer([("u", uneven)], dp, gather_format=fp8), "gather 'u'")
    partial = DTensor.from_local(torch.zeros(4, 3), tp, [Partial()])
    expect_error(ValueError, lambda: DBuffer([("p", partial)], dp), "Partial")
    even = distribute_tensor(torch.zeros(6, 3), tp, [Shard(0)])
    expect_error(ValueError, lambda: DBuffer([("e", even)], tp), "not disjoint axes")
    unnamed = init_device_mesh("cpu", (world,))
    expect_error(ValueError, lambda: DBuffer([("e", even)], unnamed), "named axes")
    expect_error(ValueError, lambda: DBuffer([("e", even)], dp, block_rows=2), "valid: [1, 3]")
    DBuffer([("e", even)], dp, block_rows=3)  # divides the 3 local rows: fine


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


def check_block_rows_forms() -> None:
    """block_rows as an int, a mapping and a function of (name, tensor) plan alike.

    The function sees each tensor as given (as fully_shard's sees (fqn, param)); the former
    (name, shape) form still works, with a DeprecationWarning.
    """
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tensors = make_tensors(world, "fp32", seed=3)
    wanted = {name: 4 if t.dim() == 2 else 1 for name, t in tensors}
    seen: dict[str, torch.Tensor] = {}

    def by_tensor(name: str, tensor: torch.Tensor) -> int:
        seen[name] = tensor
        return 4 if tensor.dim() == 2 else 1

    reference = DBuffer(tensors, mesh, block_rows=wanted).layout
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current form warns nothing
        assert DBuffer(tensors, mesh, block_rows=by_tensor).layout == reference
    assert all(seen[name] is t for name, t in tensors), sorted(seen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = DBuffer(tensors, mesh, block_rows=lambda name, shape: 4 if len(shape) == 2 else 1)
    assert old.layout == reference
    assert [w.category for w in caught] == [DeprecationWarning], caught
    assert "(name, tensor)" in str(caught[0].message), caught[0].message
    assert caught[0].filename == __file__, caught[0].filename  # points at the caller
    expect_error(
        ValueError, lambda: DBuffer(tensors, mesh, block_rows=lambda n, t: 0), "block_rows of"
    )


def check_float8_gather_is_exact(block_rows: int, cols: int, fmt: str) -> None:
    """Gathered fp8 weights equal one process's blockwise quantize-dequantize, bit for bit.

    Shards are uneven (and some ranks hold none of a tensor at W=3-4); a shard boundary
    inside a block, or a scale computed from part of a block, changes bits.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    gen = torch.Generator().manual_seed(11)
    shapes = {
        "w1": (3 * block_rows, 200),  # a ragged last column block
        "w2": ((world + 1) * block_rows, 72),
        "expert": (2, block_rows, 48),  # leading dims flattened: (2 * block_rows, 48)
        "empty": (0, 16),
    }
    tensors = [
        (n, torch.randn(s, generator=gen) * (1 + i)) for i, (n, s) in enumerate(shapes.items())
    ]
    tensors[0][1][:block_rows, :cols] = 0.0  # an all-zero block
    block = (block_rows, cols)
    buf = DBuffer(tensors, mesh, block_rows=block_rows, gather_format=BlockFloat8(block, dtype))
    sizes = [buf.layout.local_range("w2", r) for r in range(world)]
    assert world < 3 or len({hi - lo for lo, hi in sizes}) > 1, sizes  # uneven shards
    for out in (torch.float32, torch.bfloat16):
        buf.unshard(dtype=None if out == torch.float32 else out, async_op=rank % 2 == 1).wait()
        for name, t in tensors:
            got = buf.full(name, dtype=None if out == torch.float32 else out)
            expected = reference_block_qdq(t, block, dtype, out) if t.numel() else t.to(out)
            assert torch.equal(got, expected), (name, (got - expected).abs().max())
        buf.reshard()
    # The master shard is untouched, and the plain gather still gives it back.
    plain = DBuffer(tensors, mesh, block_rows=block_rows)
    assert torch.equal(buf.local, plain.local)
    expect_error(
        ValueError,
        lambda: DBuffer(tensors, mesh, block_rows=1, gather_format=BlockFloat8((2, cols), dtype)),
        "could be cut by a shard boundary",
    )
    expect_error(
        ValueError,
        lambda: DBuffer([("b", torch.ones(8))], mesh, gather_format=BlockFloat8((1, 8), dtype)),
        "'b' has shape (8,)",
    )
    expect_error(ValueError, lambda: BlockFloat8((32, 128), torch.bfloat16), "float8")
    expect_error(ValueError, lambda: BlockFloat8((0, 128)), "ints >= 1")
    expect_error(TypeError, lambda: DBuffer(tensors, mesh, gather_format="fp8"), "BlockFloat8")
    # The wire format quantizes the shard where it gathers; a host shard is not there.
    from dbuffer import HostShard

    wire = BlockFloat8((2, cols), dtype)
    expect_error(
        ValueError,
        lambda: DBuffer(tensors, mesh, gather_format=wire, host_shard=HostShard()),
        "host_shard keeps it in host memory",
    )
    expect_error(TypeError, lambda: DBuffer(tensors, mesh, host_shard=True), "HostShard")  # type: ignore[arg-type]
    expect_error(TypeError, lambda: HostShard(pin_memory="yes"), "pin_memory must be a bool")  # type: ignore[arg-type]
