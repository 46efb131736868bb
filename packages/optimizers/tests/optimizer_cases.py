"""Optimizer checks run on every rank of a RankPool, against one-process references."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ragged_optimizers import AdamW8bit, Muon
from ragged_placement import CommCounter, RaggedShard, flat_range


def ragged_rows(rows: int, world: int) -> tuple[int, ...]:
    """Uneven row counts: rank 0 empty (when world > 1), the last rank one row, rest uneven."""
    if world == 1:
        return (rows,)
    counts = [0] * world
    counts[-1] = 1 if rows > 1 else rows
    left = rows - counts[-1]
    for r in range(1, world - 1 if world > 2 else world):
        if r == world - 1:
            break
        take = left // 2 if r < world - 2 else left
        counts[r] += take
        left -= take
    counts[-1] += left
    assert sum(counts) == rows, counts
    return tuple(counts)


MUON_SHAPES = {
    "wide": (24, 40),
    "wide_b": (24, 40),  # wide, wide_b and wide_c are orthogonalized as one batch
    "tall": (50, 12),
    "one_row": (1, 40),
    "odd": (17, 17),
    "stack": (4, 12, 8),
    "conv": (8, 3, 2, 2),
    "wide_c": (24, 40),
}
BATCHED = 3  # the three (24, 40) matrices: one batch on one rank


def num_muon_units(world: int) -> int:
    """Units of MUON_SHAPES on `world` ranks: the (24, 40) matrices batch only as far as
    every owner still gets a unit (one batch on 1 rank, 2 on 2, alone on 3 or more)."""
    batches = {1: 1, 2: 2}.get(world, BATCHED)
    return len(MUON_SHAPES) - BATCHED + batches


def _placements(name: str, shape: tuple[int, ...], world: int, kind: str) -> list[Any]:
    if kind == "shard0":
        return [Shard(0)]
    if name == "stack":  # cut inside the stack's matrices: whole rows of 8 elements
        return [RaggedShard((0, 1), ragged_rows(shape[0] * shape[1], world))]
    return [RaggedShard((0,), ragged_rows(shape[0], world))]


def _full_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def _one_process_and_sharded(
    shapes: dict[str, tuple[int, ...]], kind: str
) -> tuple[Any, int, dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    """(mesh, world, full-tensor parameters, the same sharded over every rank by `kind`)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = _full_tensors(shapes, 0)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    dist_params = {
        n: torch.nn.Parameter(distribute_tensor(t, mesh, _placements(n, t.shape, world, kind)))
        for n, t in full.items()
    }
    return mesh, world, ref, dist_params


def check_muon_matches_single_process(kind: str, bucket_bytes: int) -> dict[str, Any]:
    mesh, world, ref, dist_params = _one_process_and_sharded(MUON_SHAPES, kind)
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "bucket_bytes": bucket_bytes}
    ref_opt = Muon(list(ref.items()), **kwargs)
    opt = Muon(list(dist_params.items()), **kwargs)
    plan = opt.owner_plan()
    plans: list[Any] = [None] * world
    dist.all_gather_object(plans, plan)
    assert all(p == plan for p in plans), "owner plans differ across ranks"
    assert [a.name for a in plan] == (list(MUON_SHAPES) if world > 1 else [])
    sent = []
    for step in range(3):
        grads = _full_tensors(MUON_SHAPES, 100 + step)
        if step == 1:
            grads.pop("odd")  # no gradient on any rank this step: skipped, no hang
            grads.pop("wide_b")  # the batch of wide matrices is then two
        for n, g in grads.items():
            ref[n].grad = g.clone()
            dist_params[n].grad = distribute_tensor(g, mesh, dist_params[n].placements)
        for n in set(MUON_SHAPES) - set(grads):
            ref[n].grad = dist_params[n].grad = None
        ref_opt.step()
        with CommCounter() as comms:
            opt.step()
        moved = [c for c in comms.collectives if c.kind == "all_to_all"]
        sent.append((sum(c.bytes_sent for c in moved), sum(c.bytes_received for c in moved)))
        for n in MUON_SHAPES:
            assert torch.equal(dist_params[n].full_tensor(), ref[n].detach()), (n, step)
            buf = opt.state[dist_params[n]]["momentum_buffer"]
            assert isinstance(buf, DTensor) and buf.placements == dist_params[n].placements
            assert torch.equal(buf.full_tensor(), ref_opt.state[ref[n]]["momentum_buffer"]), n
    # What this rank sends: its pieces of matrices others own, and the updates of the
    # matrices it owns to every other holder, in bfloat16; nothing for what it keeps.
    me = dist.get_rank()
    expected_sent = expected_received = 0
    for a in plan:
        mine = dist_params[a.name].to_local().numel()
        expected_sent += a.elements_out * 2 if a.owner == me else mine * 2
        expected_received += a.elements_in * 2 if a.owner == me else mine * 2
    assert sent[0][0] == sent[2][0] == expected_sent, (sent, expected_sent)
    assert sent[0][1] == sent[2][1] == expected_received, (sent, expected_received)
    return {"plan": plan, "sent": sent[0][0]}


HEAD_SHAPES = {"wq": (64, 32), "wo": (32, 64), "w1": (48, 32)}  # 4 heads of 16 in wq, wo
PER_HEAD_GROUPS = [
    {"names": ["wq"], "num_heads": 4, "heads_dim": 0},
    {"names": ["wo"], "num_heads": 4, "heads_dim": 1},
    {"names": ["w1"]},  # the whole matrix
]


def muon_per_head(params: dict[str, torch.nn.Parameter], **kwargs: Any) -> Muon:
    groups = [
        {**{k: v for k, v in g.items() if k != "names"}, "params": [params[n] for n in g["names"]]}
        for g in PER_HEAD_GROUPS
    ]
    return Muon(groups, lr=0.02, weight_decay=0.1, **kwargs)


def check_muon_per_head(kind: str) -> None:
    """Per-head Muon on ragged rows (cutting heads) or Shard(0) against one process, bitwise."""
    mesh, _, ref, dist_params = _one_process_and_sharded(HEAD_SHAPES, kind)
    ref_opt, opt = muon_per_head(ref), muon_per_head(dist_params)
    for step in range(3):
        for n, g in _full_tensors(HEAD_SHAPES, 100 + step).items():
            ref[n].grad = g.clone()
            dist_params[n].grad = distribute_tensor(g, mesh, dist_params[n].placements)
        ref_opt.step()
        opt.step()
        for n in HEAD_SHAPES:
            assert torch.equal(dist_params[n].full_tensor(), ref[n].detach()), (n, step)


def check_muon_grad_disagreement_raises() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    opt = Muon([param])
    if dist.get_rank() == 0:
        param.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)], src_data_rank=None)
    expect_error(ValueError, opt.step, "has a gradient on 1 of")


ADAM_SHAPES = {"w": (96, 70), "tall": (200, 64), "bias": (70,), "small": (8, 8), "odd": (65, 33)}


def _adam_placements(name: str, shape: tuple[int, ...], world: int, block_rows: int) -> list[Any]:
    rows = shape[0]
    blocks = -(-rows // block_rows)
    counts = ragged_rows(blocks, world)
    # Whole blocks per rank; the last rank takes the partial block at the end.
    row_counts = [c * block_rows for c in counts]
    row_counts[max(i for i, c in enumerate(counts) if c)] -= blocks * block_rows - rows
    return [RaggedShard((0,), tuple(row_counts))]


def _adam_setup(world: int, seed: int = 0) -> tuple[Any, ...]:
    mesh = init_device_mesh("cpu", (world,))
    full = {n: t * 0.1 for n, t in _full_tensors(ADAM_SHAPES, seed).items()}
    params = {
        n: torch.nn.Parameter(distribute_tensor(t, mesh, _adam_placements(n, t.shape, world, 32)))
        for n, t in full.items()
    }
    return mesh, full, params


def _adam_grads(step: int) -> dict[str, torch.Tensor]:
    grads = {n: t * 0.01 for n, t in _full_tensors(ADAM_SHAPES, 200 + step).items()}
    if step == 2:  # non-finite elements: skipped, their moments reset
        grads["w"][3, 5] = float("nan")
        grads["bias"][0] = float("inf")
    return grads


def _set_grads(params: dict[str, torch.nn.Parameter], mesh: Any, step: int, ref: Any) -> None:
    for n, g in _adam_grads(step).items():
        if ref is not None:
            ref[n].grad = g.clone()
        params[n].grad = distribute_tensor(g, mesh, params[n].placements)


def check_adamw8bit_matches_single_process() -> None:
    world = dist.get_world_size()
    mesh, full, params = _adam_setup(world)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    ref_opt = AdamW8bit(list(ref.items()))
    opt = AdamW8bit(list(params.items()))
    for step in range(4):
        _set_grads(params, mesh, step, ref)
        ref_opt.step()
        opt.step()
        for n in ADAM_SHAPES:
            assert torch.equal(params[n].full_tensor(), ref[n].detach()), (n, step)
            lo, hi = flat_range(params[n])
            for key, value in opt.state[params[n]].items():
                expected = ref_opt.state[ref[n]][key]
                if not isinstance(value, DTensor):  # the step count
                    assert torch.equal(value, expected), (n, key)
                    continue
                assert torch.equal(value.full_tensor(), expected), (n, key, step)
                local = value.to_local()
                if key.endswith("_scale"):  # the slice of the grid this rank's rows cover
                    row = 32 * ADAM_SHAPES[n][1]
                    grid = expected[lo // row : -(-hi // row)]
                    assert torch.equal(local.view(grid.shape), grid), (n, key)
                else:  # codes (or fp32 moments): exactly this rank's elements
                    assert torch.equal(local.view(-1), expected.reshape(-1)[lo:hi]), (n, key)
    assert opt.state[params["w"]]["exp_avg"].dtype == torch.uint8
    assert opt.state[params["small"]]["exp_avg"].dtype == torch.float32


def check_adamw8bit_rejects_cut_blocks() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    units = (1,) * (world - 1) + (65 - (world - 1),)
    weight = distribute_tensor(torch.zeros(65, 64), mesh, [RaggedShard((0,), units)])
    param = torch.nn.Parameter(weight)
    expect_error(ValueError, lambda: AdamW8bit([("layer.w", param)]), "layer.w of shape (65, 64)")
    expect_error(ValueError, lambda: AdamW8bit([param]), "block_rows=32")
    AdamW8bit([param], min_8bit_numel=65 * 64 + 1)  # fp32 state: any cut is fine


def _dcp_case(optimizer: str, world: int, replicas: int = 1) -> tuple[Any, ...]:
    """(mesh, full tensors, sharded params, gradients of a step, optimizer factory); with
    `replicas` > 1 Muon's mesh is HSDP's (replicas, world // replicas), Replicate first."""
    if optimizer == "adamw8bit":
        mesh, full, params = _adam_setup(world)
        return mesh, full, params, _adam_grads, lambda ps: AdamW8bit(list(ps.items()))
    shards = world // replicas
    mesh = init_device_mesh("cpu", (replicas, shards) if replicas > 1 else (world,))
    shapes = {**MUON_SHAPES, "bias": (7,)}
    full = _full_tensors(shapes, 0)
    over = [Replicate()] if replicas > 1 else []
    params = {
        n: torch.nn.Parameter(
            distribute_tensor(t, mesh, [*over, *_placements(n, t.shape, shards, "ragged")])
        )
        for n, t in full.items()
    }

    def make(ps: dict[str, torch.nn.Parameter]) -> Muon:
        matrices = [(n, p) for n, p in ps.items() if n != "bias"]
        groups = [{"params": matrices}, {"params": [("bias", ps["bias"])], "use_muon": False}]
        return Muon(groups, replica_owners=True)  # under HSDP each matrix once in the mesh

    return mesh, full, params, lambda step: _full_tensors(shapes, 300 + step), make


def check_dcp_reshard(
    directory: str, save_world: int, optimizer: str, save_replicas: int = 1
) -> None:
    """Three steps at save_world (HSDP with `save_replicas` > 1), saved with DCP; loaded
    here (one shard axis) and continued: bitwise."""
    world = dist.get_world_size()
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    class Holder(torch.nn.Module):
        def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
            super().__init__()
            for n, p in params.items():
                self.register_parameter(n, p)

    replicas = save_replicas if world == save_world else 1
    mesh, full, params, grads, make = _dcp_case(optimizer, world, replicas)
    model = Holder(params)
    opt = make(params)

    def set_grads(step: int) -> dict[str, torch.Tensor]:
        for n, g in grads(step).items():
            params[n].grad = distribute_tensor(g, mesh, params[n].placements)
        return grads(step)

    if world == save_world:
        for step in range(3):
            set_grads(step)
            opt.step()
        dcp.save(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=directory,
        )
        dist.barrier()
        return
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    if optimizer == "adamw8bit":
        loaded = opt.state[params["w"]]
        assert loaded["exp_avg"].dtype == torch.uint8
        assert loaded["exp_avg_scale"].dtype == torch.float32
    # The reference: the same 3 steps in one process, then step 4 on both.
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    ref_opt = make(ref)
    for step in range(3):
        for n, g in grads(step).items():
            ref[n].grad = g
        ref_opt.step()

    def assert_equal() -> None:
        for n in params:
            assert torch.equal(params[n].full_tensor(), ref[n].detach()), n
            for key, value in opt.state[params[n]].items():
                got = value.full_tensor() if isinstance(value, DTensor) else value
                assert got.dtype == ref_opt.state[ref[n]][key].dtype, (n, key)
                assert torch.equal(got, ref_opt.state[ref[n]][key]), (n, key)

    assert_equal()
    for n, g in set_grads(3).items():
        ref[n].grad = g
    opt.step()
    ref_opt.step()
    assert_equal()


def _doctest_globs() -> dict[str, Any]:
    return {"torch": torch}


def check_doctests() -> dict[str, Any]:
    from doctest_support import run_doctests

    return run_doctests("ragged_optimizers", _doctest_globs)


def check_muon_posts_every_bucket_before_orthogonalizing() -> int:
    """All inbound all-to-alls are in flight before the first Newton-Schulz runs."""
    import ragged_optimizers._muon as muon

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = _full_tensors(MUON_SHAPES, 0)
    params = [
        torch.nn.Parameter(distribute_tensor(t, mesh, _placements(n, t.shape, world, "ragged")))
        for n, t in full.items()
    ]
    opt = Muon(params, bucket_bytes=256)  # one bucket per unit (matrix or batch)
    for p in params:
        p.grad = distribute_tensor(torch.ones(p.shape), mesh, p.placements)
    seen: list[int] = []
    original = muon.newton_schulz

    with CommCounter() as comms:

        def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
            seen.append(comms.counts()["all_to_all"])
            return original(*args, **kwargs)

        muon.newton_schulz = recording  # type: ignore[assignment]
        try:
            opt.step()
        finally:
            muon.newton_schulz = original
    num_buckets = num_muon_units(world)
    assert comms.counts()["all_to_all"] == 2 * num_buckets  # in and back, per bucket
    if seen:  # this rank owns something: by its first NS every inbound exchange was posted
        assert seen[0] >= num_buckets, seen
    return len(seen)


# -- beside tensor parallelism: RaggedShard over dp cuts each tp rank's piece -----------------

TP_MUON = {  # name: (shape, tensor-parallel placement)
    "col": ((48, 40), Shard(0)),
    "col_b": ((48, 40), Shard(0)),  # batched with "col": same shape, same split
    "row": ((24, 40), Shard(1)),
    "rep": ((24, 40), Replicate()),
}
TP_ADAM = {
    "col": ((128, 64), Shard(0)),  # pieces of (64, 64): whole 32 x 32 blocks
    "row": ((64, 128), Shard(1)),
    "bias": ((64,), Replicate()),  # fp32 state
    "small": ((8, 8), Shard(0)),  # fp32 state (below min_8bit_numel)
}


def _tp_params(
    specs: dict[str, tuple[tuple[int, ...], Any]], block_rows: int, seed: int
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.nn.Parameter]]:
    """(dp, tp) mesh over every rank; parameters (RaggedShard over dp, their tp placement)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    full = _full_tensors({n: shape for n, (shape, _) in specs.items()}, seed)
    params = {}
    for name, (shape, tp) in specs.items():
        rows = shape[0] // (2 if tp == Shard(0) else 1)
        blocks = -(-rows // block_rows)
        counts = [c * block_rows for c in ragged_rows(blocks, mesh.size(0))]
        counts[max(i for i, c in enumerate(counts) if c)] -= blocks * block_rows - rows
        placements = [RaggedShard((0,), tuple(counts)), tp]
        params[name] = torch.nn.Parameter(distribute_tensor(full[name] * 0.1, mesh, placements))
    return mesh, {n: t * 0.1 for n, t in full.items()}, params


def check_tensor_parallel(
    optimizer: str, reverse: bool = False, replica_owners: bool | str = "auto"
) -> None:
    """Muon and AdamW8bit on (RaggedShard, Shard(d)) parameters: bitwise one process's.

    `reverse`: the parameters in reverse order (Muon: the tp-Replicate matrix first, whose
    mesh alone would look like HSDP's). `replica_owners=True`: Muon's tp-Replicate matrix
    orthogonalized once over dp x tp ranks."""
    specs = TP_MUON if optimizer == "muon" else TP_ADAM
    if reverse:
        specs = dict(reversed(list(specs.items())))
    mesh, full, params = _tp_params(specs, 1 if optimizer == "muon" else 32, seed=7)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    if optimizer == "muon":
        kwargs: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1}
        opt = Muon(list(params.items()), replica_owners=replica_owners, **kwargs)
        ref_opt = Muon(list(ref.items()), **kwargs)
        assert {a.name for a in opt.owner_plan()} == (set(specs) if mesh.size(0) > 1 else set())
    else:
        opt, ref_opt = AdamW8bit(list(params.items())), AdamW8bit(list(ref.items()))
    for step in range(3):
        grads = _full_tensors({n: shape for n, (shape, _) in specs.items()}, 300 + step)
        for name, grad in grads.items():
            ref[name].grad = grad.clone()
            params[name].grad = distribute_tensor(grad, mesh, params[name].placements)
        ref_opt.step()
        opt.step()
        for name in specs:
            assert torch.equal(params[name].full_tensor(), ref[name].detach()), (name, step)
            for key, value in opt.state[params[name]].items():
                expected = ref_opt.state[ref[name]][key]
                got = value.full_tensor() if isinstance(value, DTensor) else value
                assert torch.equal(got, expected), (name, key, step)
    if optimizer == "adamw8bit":
        assert opt.state[params["col"]]["exp_avg"].dtype == torch.uint8
        scale = opt.state[params["row"]]["exp_avg_scale"]
        assert scale.shape == (2, 4) and scale.placements[1] == Shard(1), scale
        # A tp split that cuts a 32 x 32 block: refused, naming the parameter.
        _, _, bad = _tp_params({"w": ((96, 64), Shard(0))}, 16, seed=8)
        expect_error(ValueError, lambda: AdamW8bit(list(bad.items())), "w of shape (96, 64)")


# -- HSDP: each matrix orthogonalized once in the whole mesh -----------------------------------


def _counting_ns(flops: list[int]) -> Any:
    """Wraps Muon's Newton-Schulz: adds the FLOPs of every matrix it orthogonalizes here."""
    import ragged_optimizers._muon as muon
    from ragged_optimizers import ns_flops

    original = muon.newton_schulz

    def counting(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        count = x.shape[0] if x.dim() == 3 else 1
        flops.append(count * ns_flops(tuple(x.shape[-2:]), 5))
        return original(x, *args, **kwargs)

    return muon, original, counting


def check_muon_hsdp(
    replica_owners: bool | str,
    shapes: dict[str, tuple[int, ...]],
    ns_batch_numel: int,
    flops_per_byte: float = 2048.0,
) -> dict[str, Any]:
    """Muon on a (2, 2) (replicate, shard) mesh against one process: bitwise after 3 steps;
    returns this rank's Newton-Schulz FLOPs (counted, and as `owner_plan()` plans them: slot
    = this rank), the bytes sent over the replicate axis and each matrix's copies."""
    mesh = init_device_mesh("cpu", (2, 2))
    full = _full_tensors(shapes, 0)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    dist_params = {
        n: torch.nn.Parameter(
            distribute_tensor(t, mesh, [Replicate(), *_placements(n, t.shape, 2, "ragged")])
        )
        for n, t in full.items()
    }
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "ns_batch_numel": ns_batch_numel}
    ref_opt = Muon(list(ref.items()), **kwargs)
    opt = Muon(
        list(dist_params.items()),
        replica_owners=replica_owners,
        replica_flops_per_byte=flops_per_byte,
        **kwargs,
    )
    flops: list[int] = []
    muon, original, counting = _counting_ns(flops)
    gathered = exchanged = 0
    for step in range(3):
        grads = _full_tensors(shapes, 100 + step)
        for n, g in grads.items():
            ref[n].grad = g.clone()
            dist_params[n].grad = distribute_tensor(g, mesh, dist_params[n].placements)
        ref_opt.step()
        muon.newton_schulz = counting  # type: ignore[assignment]
        try:
            with CommCounter() as comms:
                opt.step()
        finally:
            muon.newton_schulz = original
        gathered += sum(c.bytes_sent for c in comms.collectives if c.kind == "all_gather")
        exchanged += sum(c.bytes_sent for c in comms.collectives if c.kind == "all_to_all")
        for n in shapes:
            assert torch.equal(dist_params[n].full_tensor(), ref[n].detach()), (n, step)
    piece = next(iter(dist_params.values())).to_local().numel()
    plan = opt.owner_plan()
    # The README's formula, per rank and step (bfloat16: 2 bytes per element). Over the
    # shard axis, for each matrix its replica orthogonalizes: the owner sends every other
    # holder its piece of the update, the others send the owner their pieces. Over the
    # replicate axis: its pieces of the matrices each other replica orthogonalized once,
    # padded to the largest replica's share, to each of the R - 1 others.
    replica, shard = divmod(dist.get_rank(), 2)
    expected_exchange, shares = 0, [0, 0]
    for a in plan:
        mine = dist_params[a.name].to_local().numel()
        if a.num_copies == 1:
            shares[a.owner // 2] += mine
        if a.num_copies == 2 or a.owner // 2 == replica:
            expected_exchange += (a.elements_out if a.owner % 2 == shard else mine) * 2
    expected_gather = max(shares) * 2 * (2 - 1) if shares != [0, 0] else 0
    assert exchanged == 3 * expected_exchange, (exchanged, expected_exchange)
    assert gathered == 3 * expected_gather, (gathered, expected_gather)
    return {
        "flops": sum(flops) // 3,
        "planned": plan.loads[dist.get_rank()],
        "copies": {a.name: a.num_copies for a in plan},
        "gathered_bytes": gathered // 3,
        "piece": piece,
    }


TP_MANY = {  # 8 column- and 8 row-parallel matrices, one matrix per batch
    **{f"col{i}": ((48, 40), Shard(0)) for i in range(8)},
    **{f"row{i}": ((24, 40), Shard(1)) for i in range(8)},
}


TP_REPLICATED = {f"rep{i}": ((32, 40), Replicate()) for i in range(8)}


def _tp_step_counted(
    specs: dict[str, tuple[tuple[int, ...], Any]], seed: int, **kwargs: Any
) -> tuple[dict[str, torch.nn.Parameter], Muon, int, CommCounter]:
    """One Muon step on (dp, tp) = (2, 2) parameters: (params, optimizer, this rank's
    Newton-Schulz FLOPs, the step's collectives)."""
    _, _, params = _tp_params(specs, 1, seed=seed)
    opt = Muon(list(params.items()), lr=0.02, **kwargs)
    grads = _full_tensors({n: shape for n, (shape, _) in specs.items()}, 300 + seed)
    for name, grad in grads.items():
        params[name].grad = distribute_tensor(
            grad, params[name].device_mesh, params[name].placements
        )
    flops: list[int] = []
    muon, original, counting = _counting_ns(flops)
    muon.newton_schulz = counting  # type: ignore[assignment]
    try:
        with CommCounter() as comms:
            opt.step()
    finally:
        muon.newton_schulz = original
    return params, opt, sum(flops), comms


def check_muon_tp_replicated_flops(replica_owners: bool) -> int:
    """This rank's Newton-Schulz FLOPs of one step on 8 tp-Replicate matrices at (2, 2)."""
    return _tp_step_counted(TP_REPLICATED, 5, replica_owners=replica_owners)[2]


def check_muon_tp_flops(tp_owners: bool) -> dict[str, int]:
    """This rank's Newton-Schulz FLOPs of one step on TP_MANY at (dp, tp) = (2, 2), and
    the bytes it sent over tp; its bytes over dp checked against the formula."""
    params, opt, flops, comms = _tp_step_counted(TP_MANY, 7, tp_owners=tp_owners, ns_batch_numel=1)
    # Over dp, the 1-D formula on each matrix's tp block (see check_muon_matches_single_process).
    mesh = params["col0"].device_mesh
    dp_rank, dp_size = mesh.get_local_rank(0), mesh.size(0)
    expected = 0
    plan = opt.owner_plan()  # slots: tp rank slot // dp_size, dp owner slot % dp_size
    for a in plan:
        mine = params[a.name].to_local().numel()
        expected += (a.elements_out if a.owner % dp_size == dp_rank else mine) * 2
    exchanged = sum(c.bytes_sent for c in comms.collectives if c.kind == "all_to_all")
    assert exchanged == expected, (exchanged, expected)
    over_tp = sum(c.bytes_sent for c in comms.collectives if c.kind in ("gather", "scatter"))
    if not tp_owners:
        assert over_tp == 0, comms.collectives
    else:  # the plan's slot for this rank: what it computes, as planned
        slot = mesh.get_local_rank(1) * dp_size + dp_rank
        assert flops == plan.loads[slot], (flops, plan.loads)
    return {"flops": flops, "tp_bytes": over_tp}
