"""RaggedShard's placement checks, run on every rank of a RankPool (see rank_pool.py).

distribute / from_local / full_tensor, redistribute between every placement pair (bytes
asserted with CommCounter against the volumes the module docs promise), with_local, HSDP,
bad input and the docstring examples. Each compares with the single-process result on the
full tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ragged_support import make_mesh, reference_tensor, unit_ranges
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ragged_placement import (
    CommCounter,
    RaggedShard,
    flat_range,
    local_view,
    with_local,
    with_locals,
)


def check_roundtrip(
    shape: tuple[int, ...],
    units: tuple[int, ...],
    dims: tuple[int, ...],
    dtype: str,
    src: int | None,
) -> dict[str, Any]:
    mesh, rank = make_mesh(), dist.get_rank()
    full = reference_tensor(shape, dtype)
    placement = RaggedShard(dims, units)
    with CommCounter() as comms:
        dt = distribute_tensor(full, mesh, [placement], src_data_rank=src)
    if src is None:  # every rank has the data: nothing is sent
        assert comms.collectives == [], comms.collectives
    lo, hi = unit_ranges(units, full.numel())[rank]
    assert dt.placements == (placement,) and dt.shape == full.shape
    assert dt.to_local().dim() == 1
    assert torch.equal(dt.to_local(), full.reshape(-1)[lo:hi])
    assert flat_range(dt) == (lo, hi)
    assert local_view(dt).shape[1:] == full.shape[len(dims) :]
    with CommCounter() as comms:
        gathered = dt.full_tensor()
    assert torch.equal(gathered, full)
    itemsize = full.element_size()
    assert comms.bytes_received == (full.numel() - (hi - lo)) * itemsize, comms.collectives
    again = DTensor.from_local(dt.to_local(), mesh, [placement], shape=full.shape)
    assert torch.equal(again.full_tensor(), full)
    return {"received": comms.bytes_received, "kinds": dict(comms.counts())}


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def check_redistribute(
    shape: tuple[int, ...], old: tuple[int, ...], new: tuple[int, ...], dtype: str
) -> None:
    mesh, rank, world = make_mesh(), dist.get_rank(), dist.get_world_size()
    full = reference_tensor(shape, dtype, seed=1)
    size, numel = full.element_size(), full.numel()
    a, b = RaggedShard((0,), old), RaggedShard((0,), new)
    dt = distribute_tensor(full, mesh, [a], src_data_rank=None)
    old_r, new_r = unit_ranges(old, numel), unit_ranges(new, numel)

    # RaggedShard -> RaggedShard: only the overlaps that move, one all-to-all.
    with CommCounter() as comms:
        moved = dt.redistribute(mesh, [b])
    assert torch.equal(moved.to_local(), full.reshape(-1)[new_r[rank][0] : new_r[rank][1]])
    sent = sum(_overlap(old_r[rank], new_r[j]) for j in range(world) if j != rank)
    received = sum(_overlap(old_r[j], new_r[rank]) for j in range(world) if j != rank)
    assert (comms.bytes_sent, comms.bytes_received) == (sent * size, received * size), (
        comms.collectives
    )
    assert comms.counts() == ({"all_to_all": 1} if world > 1 and old != new else {}), comms.counts()

    # async_op=True: the all-to-all completes lazily; compute first, then read the result.
    pending = dt.redistribute(mesh, [b], async_op=True)
    if world > 1 and old != new:
        assert type(pending.to_local()).__name__ == "AsyncCollectiveTensor"
    flat = full.float().reshape(full.shape[0], -1)
    (flat @ flat.T).sum()  # work overlapping the collective
    assert torch.equal(pending.to_local(), moved.to_local())
    assert torch.equal(dt.redistribute(mesh, [Replicate()], async_op=True).full_tensor(), full)

    # Replicate -> RaggedShard: no communication at all.
    rep = distribute_tensor(full, mesh, [Replicate()], src_data_rank=None)
    with CommCounter() as comms:
        sliced = rep.redistribute(mesh, [a])
    assert comms.collectives == [] and torch.equal(sliced.to_local(), dt.to_local())

    # Shard(0) <-> RaggedShard: a Shard(0) chunk is a flat range, so one exchange each way.
    with CommCounter() as to_shard0:
        shard0 = dt.redistribute(mesh, [Shard(0)])
    assert torch.equal(
        shard0.to_local(), distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()
    )
    with CommCounter() as comms:
        back = shard0.redistribute(mesh, [a])
    assert torch.equal(back.to_local(), dt.to_local())
    rows, row = shape[0], numel // shape[0]
    chunk = -(-rows // world)
    s0_ranges = [
        (min(j * chunk, rows) * row, min((j + 1) * chunk, rows) * row) for j in range(world)
    ]
    s0_sent = sum(_overlap(s0_ranges[rank], old_r[j]) for j in range(world) if j != rank)
    s0_received = sum(_overlap(s0_ranges[j], old_r[rank]) for j in range(world) if j != rank)
    assert (comms.bytes_sent, comms.bytes_received) == (s0_sent * size, s0_received * size)
    # ... and the other way round the same overlaps move in the opposite direction.
    assert (to_shard0.bytes_sent, to_shard0.bytes_received) == (s0_received * size, s0_sent * size)

    # Shard(d) for every other dim, both ways.
    # RaggedShard -> Shard(d) gathers the missing elements, then slices locally; Shard(d) ->
    # RaggedShard is torch's own Shard(d) -> Replicate, then a local slice.
    for d in range(1, full.dim()):
        with CommCounter() as comms:
            shard_d = dt.redistribute(mesh, [Shard(d)])
        assert comms.bytes_received == (numel - (old_r[rank][1] - old_r[rank][0])) * size
        assert torch.equal(shard_d.full_tensor(), full)
        with CommCounter() as comms:
            back_d = shard_d.redistribute(mesh, [a])
        assert torch.equal(back_d.to_local(), dt.to_local())
        with CommCounter() as torch_gather:
            shard_d.redistribute(mesh, [Replicate()])
        # Exactly torch's own Shard(d) -> Replicate, and nothing on top.
        assert comms.bytes_received == torch_gather.bytes_received, comms.collectives

    # Partial -> RaggedShard: a reduce-scatter's volume, not an all-reduce's.
    partial = DTensor.from_local(full * (rank + 1), mesh, [Partial()], run_check=False)
    with CommCounter() as comms:
        reduced = partial.redistribute(mesh, [b])
    expected = (
        (full.float() * (world * (world + 1) / 2))
        .to(full.dtype)
        .reshape(-1)[new_r[rank][0] : new_r[rank][1]]
    )
    torch.testing.assert_close(reduced.to_local(), expected, rtol=1e-2, atol=1e-2)
    if world > 1:
        assert comms.counts() == {"reduce_scatter": 1}
        assert comms.bytes_sent == (numel - (new_r[rank][1] - new_r[rank][0])) * size


def check_counter_sees_torch_collectives(rows: int) -> None:
    mesh, world = make_mesh(), dist.get_world_size()
    full = reference_tensor((rows, 4), seed=9)
    dt = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    with CommCounter() as comms:
        dt.full_tensor()  # torch's own path: a functional all-gather
    if world > 1:
        assert comms.counts() == {"all_gather": 1}, comms.collectives
        assert comms.collectives[0].op.startswith("_c10d_functional")
        assert comms.collectives[0].group_size == world
        assert comms.bytes_received == dt.to_local().numel() * 4 * (world - 1)
    # gather / scatter to / from the last rank: only the pieces that leave a rank count.
    root, piece = world - 1, torch.full((3,), float(dist.get_rank()))
    gathered = [torch.empty(3) for _ in range(world)] if dist.get_rank() == root else None
    with CommCounter() as comms:
        dist.gather(piece, gathered, dst=root)
        dist.scatter(piece, gathered, src=root)
    if world > 1:
        assert comms.counts() == {"gather": 1, "scatter": 1}, comms.collectives
        others = 3 * 4 * (world - 1)
        mine = (0, others) if dist.get_rank() == root else (3 * 4, 0)  # gather: sent, received
        assert [(c.bytes_sent, c.bytes_received) for c in comms.collectives] == [
            mine,
            mine[::-1],  # scatter: the other way
        ], comms.collectives
    assert torch.equal(piece, torch.full((3,), float(dist.get_rank())))


def check_one_hot_gather(shape: tuple[int, ...], owner: int) -> dict[str, int]:
    mesh, rank, world = make_mesh(), dist.get_rank(), dist.get_world_size()
    full = reference_tensor(shape, seed=2)
    balanced = RaggedShard((0,), (1,) * world)
    one_hot = RaggedShard((0,), tuple(int(r == owner) for r in range(world)))
    dt = distribute_tensor(full, mesh, [balanced], src_data_rank=None)
    with CommCounter() as comms:
        gathered = dt.redistribute(mesh, [one_hot])
    if rank == owner:
        assert torch.equal(gathered.to_local(), full.reshape(-1))
        assert torch.equal(local_view(gathered), full)
    else:
        assert gathered.to_local().numel() == 0
        assert comms.bytes_received == 0
    back = gathered.redistribute(mesh, [balanced])
    assert torch.equal(back.to_local(), dt.to_local())
    return {"received": comms.bytes_received, "sent": comms.bytes_sent}


def check_with_local(shape: tuple[int, ...], units: tuple[int, ...]) -> None:
    """with_local over new memory == from_local of the same piece, and its full tensor."""
    mesh = make_mesh()
    full = reference_tensor(shape)
    placement = RaggedShard((0,), units)
    dt = distribute_tensor(full, mesh, [placement])
    lo, hi = flat_range(dt)
    doubled = (2 * full).reshape(-1)[lo:hi].clone()
    made = with_local(dt, doubled)
    assert made.placements == dt.placements and made.shape == dt.shape
    assert made.stride() == dt.stride() and not made.requires_grad
    assert made.to_local().data_ptr() == doubled.data_ptr()  # a view, no copy
    assert torch.equal(made.full_tensor(), 2 * full)
    assert torch.equal((made + dt).full_tensor(), 3 * full)  # ops see the same spec
    expect_error(ValueError, lambda: with_local(dt, doubled.double()), "float64")
    expect_error(ValueError, lambda: with_local(dt, torch.zeros(hi - lo + 1)), "got (")
    expect_error(ValueError, lambda: with_local(dt, doubled.to("meta")), "meta")
    expect_error(TypeError, lambda: with_local(full, doubled), "expected a DTensor")  # type: ignore[arg-type]
    expect_error(TypeError, lambda: with_local(dt, dt), "plain tensor")
    # with_locals: the same, for many at once; bad input names the first offender.
    other = distribute_tensor(full[:1].clone(), mesh, [Replicate()])
    made_all = with_locals([dt, other, dt], [doubled, other.to_local() * 3, doubled * 0])
    assert [m.placements for m in made_all] == [dt.placements, other.placements, dt.placements]
    assert made_all[0].to_local().data_ptr() == doubled.data_ptr()
    assert torch.equal(made_all[0].full_tensor(), 2 * full)
    assert torch.equal(made_all[1].full_tensor(), 3 * full[:1])
    assert not made_all[2].full_tensor().any() and with_locals([], []) == []
    expect_error(ValueError, lambda: with_locals([dt, dt], [doubled]), "2 DTensors but 1")
    expect_error(ValueError, lambda: with_locals([dt, dt], [doubled, doubled.double()]), "float64")
    expect_error(TypeError, lambda: with_locals([dt, full], [doubled, doubled]), "DTensor")  # type: ignore[list-item]
    expect_error(TypeError, lambda: with_locals([dt], [dt]), "plain tensor")


def check_hsdp(shape: tuple[int, ...], units: tuple[int, int]) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    full = reference_tensor(shape, seed=8)
    placement = RaggedShard((0,), units)
    dt = distribute_tensor(full, mesh, [Replicate(), placement], src_data_rank=None)
    lo, hi = unit_ranges(units, full.numel())[mesh.get_local_rank("shard")]
    assert torch.equal(dt.to_local(), full.reshape(-1)[lo:hi])
    with CommCounter() as comms:
        assert torch.equal(dt.full_tensor(), full)
    # Gathered within the shard axis only: this rank receives the other piece of its pair.
    assert all(c.group_size == 2 for c in comms.collectives), comms.collectives
    assert comms.bytes_received == (full.numel() - (hi - lo)) * full.element_size()
    other = RaggedShard((0,), tuple(reversed(units)))
    assert torch.equal(dt.redistribute(mesh, [Replicate(), other]).full_tensor(), full)
    assert torch.equal(dt.redistribute(mesh, [Shard(0), Replicate()]).full_tensor(), full)
    grads = DTensor.from_local(
        full * (dist.get_rank() + 1), mesh, [Partial(), Partial()], run_check=False
    )
    reduced = grads.redistribute(mesh, [Replicate(), placement])
    torch.testing.assert_close(reduced.full_tensor(), full * 10)
    torch.testing.assert_close((dt * 2).sum().full_tensor(), full.sum() * 2)


def check_bad_input() -> None:
    mesh, world = make_mesh(), dist.get_world_size()
    full = reference_tensor((4 * world, 3))
    ok = (1,) * world
    expect_error(
        ValueError,
        lambda: distribute_tensor(full, mesh, [RaggedShard((0,), (1,) * (world + 1))]),
        "local_units (the axis size)",
    )
    expect_error(
        ValueError,
        lambda: distribute_tensor(
            torch.randn(world * 2 + 1, 3), mesh, [RaggedShard((0,), (2,) + (0,) * (world - 1))]
        ),
        "whole rows",
    )
    expect_error(
        ValueError,
        lambda: distribute_tensor(full.t(), mesh, [RaggedShard((0,), ok)]),
        "must be contiguous",
    )
    expect_error(
        ValueError,
        lambda: DTensor.from_local(torch.randn(3), mesh, [RaggedShard((0,), ok)]),
        "needs shape=",
    )
    expect_error(
        ValueError,
        lambda: DTensor.from_local(torch.randn(5), mesh, [RaggedShard((0,), ok)], shape=full.shape),
        "must be 1-D with 12 elements",
    )
    if world >= 2:
        mesh2 = init_device_mesh("cpu", (world // 2, 2)) if world % 2 == 0 else None
        if mesh2 is not None:
            two = [RaggedShard((0,), (1,) * (world // 2)), RaggedShard((0,), (1, 1))]
            expect_error(
                ValueError, lambda: distribute_tensor(full, mesh2, two), "at most one RaggedShard"
            )
    if world % 2 == 0:
        # A mesh of another shape over the same ranks is a different mesh.
        other_mesh = init_device_mesh("cpu", (2, world // 2))
        dt = distribute_tensor(full, mesh, [RaggedShard((0,), ok)])
        try:
            dt.redistribute(other_mesh, [Replicate(), Replicate()])
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            assert "mesh" in str(exc).lower(), exc
        else:
            raise AssertionError("redistributing onto another mesh must raise")


def _doctest_globs() -> dict[str, Any]:
    mesh = make_mesh()
    weight = torch.arange(32.0).reshape(8, 4)
    dt = distribute_tensor(weight, mesh, [RaggedShard((0,), (8,))])
    return {
        "torch": torch,
        "mesh": mesh,
        "weight": weight,
        "dt": dt,
        "Replicate": Replicate,
        "distribute_tensor": distribute_tensor,
    }


def check_doctests() -> dict[str, Any]:
    from doctest_support import run_doctests

    return run_doctests("ragged_placement", _doctest_globs)
