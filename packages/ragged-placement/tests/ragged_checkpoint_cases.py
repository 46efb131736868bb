"""State dicts of RaggedShard DTensors: full loads, DCP across world sizes, with TP, strided."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ragged_support import make_mesh, reference_tensor, unit_ranges
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ragged_placement import (
    CommCounter,
    RaggedShard,
    flat_range,
    local_view,
)


def check_load_full_state_dict(broadcast: bool, units: tuple[int, ...]) -> None:
    """set_model_state_dict with a full state dict (from rank 0 only, with broadcast_from_rank0)
    into a module whose parameters are RaggedShard DTensors: each gets its piece."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    mesh = make_mesh()
    rows = 2 * sum(units)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(3, rows), nn.Linear(rows, rows, bias=False))
    full = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model = nn.Sequential(nn.Linear(3, rows), nn.Linear(rows, rows, bias=False))
    for module in model:
        for name, param in list(module.named_parameters(recurse=False)):
            zeros = torch.zeros_like(param)
            ragged = distribute_tensor(zeros, mesh, [RaggedShard((0,), units)], src_data_rank=None)
            setattr(module, name, nn.Parameter(ragged))
    # torch replaces the given dict's entries with what it loaded: give it a copy.
    given = dict(full) if (not broadcast or dist.get_rank() == 0) else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_model_state_dict(model, given, options=options)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and isinstance(param.placements[0], RaggedShard)
        assert torch.equal(param.full_tensor(), full[name]), (name, broadcast, units)
    # A tensor of another shape: an error on every rank (from torch, or from the piece cut
    # after the broadcast), not a hang or a silent partial load.
    bad = {**full, "0.weight": torch.zeros(rows, 4)}
    expected = f"shape ({rows}, 4) into a DTensor of shape ({rows}, 3)"
    error: type[Exception] = ValueError
    if not broadcast:
        expected, error = "size mismatch for 0.weight", RuntimeError
    given = dict(bad) if (not broadcast or dist.get_rank() == 0) else {}
    expect_error(error, lambda: set_model_state_dict(model, given, options=options), expected)


def _checkpoint_tensors() -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    # name -> (shape, dims); sizes divisible by every unit sum used in the tests (1..12).
    return {"w": ((24, 5, 4), (0, 1)), "b": ((48,), (0,)), "m": ((12, 32768), (0,))}


def check_dcp_save(path: str, units: tuple[int, ...]) -> dict[str, int]:
    import torch.distributed.checkpoint as dcp

    mesh = make_mesh()
    state = {
        name: distribute_tensor(
            reference_tensor(shape, seed=40 + i),
            mesh,
            [RaggedShard(dims, units)],
            src_data_rank=None,
        )
        for i, (name, (shape, dims)) in enumerate(_checkpoint_tensors().items())
    }
    with CommCounter() as comms:
        dcp.save(state, checkpoint_id=path)
    data = sum(t.to_local().numel() * t.element_size() for t in state.values())
    return {"collective_bytes": comms.bytes_sent + comms.bytes_received, "data_bytes": data}


def check_dcp_load(path: str, kind: str, units: tuple[int, ...]) -> None:
    import torch.distributed.checkpoint as dcp

    mesh = make_mesh()
    state = {}
    for name, (shape, dims) in _checkpoint_tensors().items():
        placement = {
            "ragged": RaggedShard(dims, units),
            "shard0": Shard(0),
            "replicate": Replicate(),
        }[kind]
        state[name] = distribute_tensor(torch.zeros(shape), mesh, [placement], src_data_rank=None)
    dcp.load(state, checkpoint_id=path)
    for i, (name, (shape, _)) in enumerate(_checkpoint_tensors().items()):
        assert torch.equal(state[name].full_tensor(), reference_tensor(shape, seed=40 + i)), (
            name,
            kind,
            units,
        )


def check_with_tensor_parallel(layout: str, units: tuple[int, int], path: str) -> None:
    """RaggedShard composed with Shard(d) of the other mesh axis: it cuts the local block.
    "tp":  mesh (fsdp, tp), placements [RaggedShard, Shard(1)] on a (rows, cols) weight;
    "ep":  mesh (ep, fsdp), placements [Shard(0), RaggedShard((0, 1))] on (experts, in, out).
    """

    mesh = init_device_mesh("cpu", (2, 2))
    if layout == "tp":
        full = reference_tensor((6 * sum(units), 6), seed=50)
        placements = [RaggedShard((0,), units), Shard(1)]
        block = full[:, 3 * mesh.get_local_rank(1) : 3 * mesh.get_local_rank(1) + 3]
        ragged_axis = 0
    else:
        full = reference_tensor((4, sum(units), 3), seed=51)
        placements = [Shard(0), RaggedShard((0, 1), units)]
        block = full[2 * mesh.get_local_rank(0) : 2 * mesh.get_local_rank(0) + 2]
        ragged_axis = 1
    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
    lo, hi = unit_ranges(units, block.numel())[mesh.get_local_rank(ragged_axis)]
    assert torch.equal(dt.to_local(), block.reshape(-1)[lo:hi])
    assert torch.equal(dt.full_tensor(), full)
    # Gather only the ragged axis: the other placement stays.
    half = list(placements)
    half[ragged_axis] = Replicate()
    partly = dt.redistribute(mesh, half)
    assert torch.equal(partly.to_local(), block)
    assert torch.equal(partly.redistribute(mesh, placements).to_local(), dt.to_local())
    torch.testing.assert_close((dt * 3).full_tensor(), full * 3)
    torch.testing.assert_close(dt.mean().full_tensor(), full.mean())
    torch.testing.assert_close(
        torch.linalg.vector_norm(dt).full_tensor(), torch.linalg.vector_norm(full)
    )
    # Checkpoint: boxes in global coordinates, loaded back into other layouts.
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": dt}, checkpoint_id=path)
    swapped = list(placements)
    swapped[ragged_axis] = RaggedShard(placements[ragged_axis].dims, tuple(reversed(units)))
    for target in (swapped, [Replicate(), Replicate()]):
        into = {"x": distribute_tensor(torch.zeros_like(full), mesh, target, src_data_rank=None)}
        dcp.load(into, checkpoint_id=path)
        assert torch.equal(into["x"].full_tensor(), full), target


def check_strided(units: tuple[int, int], path: str) -> None:
    """StridedRaggedShard on (fsdp, tp): ragged pieces of the whole tensor, split by tp rows."""
    import torch.distributed.checkpoint as dcp

    from ragged_placement import StridedRaggedShard

    mesh = init_device_mesh("cpu", (2, 2))
    r, t = mesh.get_local_rank(0), mesh.get_local_rank(1)
    full = reference_tensor((5 * sum(units), 3), seed=60)
    placements = [StridedRaggedShard((0,), units, split_factor=2), Shard(0)]
    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
    first = 5 * sum(units[:r])
    piece = full[first : first + 5 * units[r]]
    size = -(-piece.shape[0] // 2)  # torch.chunk semantics: ceil-sized parts, last ones short
    chunk = piece[min(t * size, piece.shape[0]) : min((t + 1) * size, piece.shape[0])]
    assert torch.equal(local_view(dt), chunk), (local_view(dt), chunk)
    assert torch.equal(dt.full_tensor(), full)
    assert flat_range(dt)[1] - flat_range(dt)[0] == chunk.numel()
    plain = dt.redistribute(mesh, [RaggedShard((0,), units), Replicate()])
    assert torch.equal(plain.to_local(), piece.reshape(-1))
    assert torch.equal(plain.redistribute(mesh, placements).to_local(), dt.to_local())
    rep = distribute_tensor(full, mesh, [Replicate(), Replicate()], src_data_rank=None)
    assert torch.equal(rep.redistribute(mesh, placements).to_local(), dt.to_local())
    torch.testing.assert_close((dt * 2 + 1).full_tensor(), full * 2 + 1)
    torch.testing.assert_close(dt.sum().full_tensor(), full.sum())
    torch.testing.assert_close(
        torch.linalg.vector_norm(dt).full_tensor(), torch.linalg.vector_norm(full)
    )
    dcp.save({"x": dt}, checkpoint_id=path)
    for target in (
        [RaggedShard((0,), tuple(reversed(units))), Replicate()],
        [Replicate(), Shard(0)],
        placements,
    ):
        into = {"x": distribute_tensor(torch.zeros_like(full), mesh, target, src_data_rank=None)}
        dcp.load(into, checkpoint_id=path)
        assert torch.equal(into["x"].full_tensor(), full), target
    try:
        distribute_tensor(full, mesh, [StridedRaggedShard((0,), units, split_factor=3), Shard(0)])
    except ValueError as exc:
        assert "Shard(0) of size 3" in str(exc), exc
    else:
        raise AssertionError("a split_factor that is not the Shard(0) axis size must raise")
