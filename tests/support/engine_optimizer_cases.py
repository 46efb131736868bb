"""Both optimizers on a fully_shard model, on every rank of a RankPool.

Each step the engine computes the gradients (forward and backward on this rank's rows, then
its reduce-scatter); the optimizer then updates the RaggedShard parameters. The reference is
the same optimizer in one process on full tensors, given the full gradients of that step: the
sharded update must equal it bitwise. Gradients of data-parallel training differ from one
process's by summation order, so the loss curve is compared with a one-process run separately,
within a tolerance.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, loss_fn
from rank_pool import expect_error
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from train import make_optimizer

import fsdp_engine
from fsdp_engine import fully_shard
from ragged_placement import RaggedShard

CONFIG = Config(vocab=96, dim=64, num_heads=4, num_layers=2, hidden=96)
BATCH_PER_RANK, SEQ, STEPS = 2, 16, 10


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    rows = dist.get_world_size() * BATCH_PER_RANK
    # One batch, repeated: the loss must then fall clearly within 10 steps.
    return [torch.randint(0, CONFIG.vocab, (rows, SEQ), generator=gen)] * STEPS


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_engine_training(optimizer: str, offload: bool = False) -> dict[str, Any]:
    """`optimizer` on the sharded model: equal to it on full tensors, close to one process.

    `offload`: the groups with `CPUOffloadPolicy`, so the optimizer steps host tensors.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Decoder(CONFIG)
    reference = Decoder(CONFIG)
    reference.load_state_dict(model.state_dict())
    one_process = Decoder(CONFIG)
    one_process.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    block_rows = lambda fqn, p: 32 if p.dim() == 2 else 1  # noqa: E731
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, block_rows=block_rows, offload_policy=policy)
    fully_shard(model, mesh=mesh, block_rows=block_rows, offload_policy=policy)
    for name, p in model.named_parameters():
        assert isinstance(p.placements[0], RaggedShard), name
    lr = 1e-2
    opt = make_optimizer(optimizer, model, lr)
    ref_opt = make_optimizer(optimizer, reference, lr)
    one_opt = make_optimizer(optimizer, one_process, lr)
    losses, one_losses = [], []
    for batch in _batches():
        mine = batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        loss = loss_fn(model(mine), mine)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            ref.grad = _full(p.grad).clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(_full(p.detach()), ref.detach()), name
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        one_loss = loss_fn(one_process(batch), batch)
        one_loss.backward()
        torch.nn.utils.clip_grad_norm_(one_process.parameters(), 1.0)
        one_opt.step()
        one_opt.zero_grad()
        one_losses.append(one_loss.item())
    if optimizer == "adamw8bit":
        codes = [v for s in opt.state.values() for k, v in s.items() if k == "exp_avg"]
        assert sum(c.dtype == torch.uint8 for c in codes) >= 6  # the blocks' matrices, embed, head
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_losses), atol=2e-3, rtol=0)
    assert losses[-1] < losses[0] - 0.5, losses  # it trains
    return {"losses": losses, "one_process": one_losses}


# -- the flat AdamW against torch's AdamW on the same sharded model ------------------------------

MOE = Config(vocab=96, dim=64, num_heads=4, num_layers=2, hidden=64, num_experts=4)


def _flat_adamw_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weight decay on the matrices, none on the rest (their runs interleave in the shard)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]


def _sharded(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy()
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _route(model: torch.nn.Module, tokens: int, first_token: int, num_experts: int = 3) -> None:
    """Every token to two of the first `num_experts` experts by its index in the whole batch
    (with 3 of 4 the last gets no gradient on any rank), where it goes in one process."""
    for layer in model.layers:  # type: ignore[union-attr]
        first = (torch.arange(tokens) + first_token) % num_experts
        layer.mlp.forced_choice = torch.stack([first, (first + 1) % num_experts], 1)


def check_flat_adamw_on_engine(kind: str, precision: str) -> dict[str, Any]:
    """ragged_optimizers.AdamW against torch.optim.AdamW(foreach=True) on one sharded model.

    Two copies of one sharded model: parameters and every state tensor equal bit for bit
    after each of 5 steps. In fp32 also close to one process (torch's AdamW on the whole
    batch); in bf16 mixed precision AdamW turns a gradient's rounding near zero into a whole
    step (lr) for that element, so there the bitwise check is the one. eps is 1e-4 for the
    same reason in fp32: with 1e-8 a gradient that cancels to ~1e-9 (its sign set by the
    order of the sums, which sharding changes) still moves its element by lr, and the dense
    model at W=2 on torch 2.13 drifted 2.6 lr (0.026) from one process in 5 steps.
    """
    from ragged_optimizers import AdamW

    world, rank = dist.get_world_size(), dist.get_rank()
    config = MOE if kind == "moe" else CONFIG
    torch.manual_seed(0)
    base = Decoder(config)
    copies = [Decoder(config) for _ in range(2)]
    for model in copies:
        model.load_state_dict(base.state_dict())
    ours, theirs = _sharded(copies[0], precision), _sharded(copies[1], precision)
    kwargs = {"lr": 1e-2, "amsgrad": True, "eps": 1e-4}
    opt = AdamW(_flat_adamw_groups(ours), **kwargs)
    ref_opt = torch.optim.AdamW(_flat_adamw_groups(theirs), foreach=True, **kwargs)
    one_opt = torch.optim.AdamW(_flat_adamw_groups(base), foreach=True, **kwargs)
    gen = torch.Generator().manual_seed(1)
    losses, one_losses = [], []
    for _ in range(5):
        batch = torch.randint(0, config.vocab, (world * BATCH_PER_RANK, SEQ), generator=gen)
        mine = batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        runs = [(ours, opt, mine), (theirs, ref_opt, mine), (base, one_opt, batch)]
        for model, optimizer, rows in runs:
            if kind == "moe":
                first_token = 0 if rows is batch else rank * mine.numel()
                _route(model, rows.numel(), first_token)
            loss = loss_fn(model(rows), rows)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if model is ours:
                value = loss.detach().float()
                dist.all_reduce(value)
                losses.append(value.item() / world)
            elif model is base:
                one_losses.append(loss.item())
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p.to_local(), q.to_local()), name
            assert sorted(opt.state[p]) == sorted(ref_opt.state[q]), name
            for key, value in ref_opt.state[q].items():
                got = opt.state[p][key]
                if isinstance(value, DTensor):
                    assert isinstance(got, DTensor), (name, key)
                    assert got.placements == value.placements, (name, key)
                    got, value = got.to_local(), value.to_local()
                assert torch.equal(got, value), (name, key)
    named = dict(ours.named_parameters())
    if kind == "moe":  # the unused expert never stepped: no state, as with torch's AdamW
        unused = [p for n, p in named.items() if ".experts.3." in n]
        assert unused and not any(opt.state[p] for p in unused)
    num_runs = sum(len(group.runs) for group in opt._runs.values())
    if kind == "moe":  # the experts' matrices coalesce (the dense model's norms cut its runs)
        assert num_runs < len(named) / 2, (num_runs, len(named))
    if precision == "fp32":
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(one_losses), atol=2e-4, rtol=0
        )
        for (name, p), q in zip(named.items(), base.parameters(), strict=True):
            torch.testing.assert_close(_full(p.detach()), q.detach(), atol=2e-4, rtol=0, msg=name)
    return {"losses": losses, "one_process": one_losses, "runs": num_runs, "params": len(named)}


def _engine_model(engine: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The MoE decoder sharded by `engine` ("ours": fully_shard and ragged_optimizers.AdamW;
    "fsdp2": torch's fully_shard and torch.optim.AdamW), fp32."""
    from ragged_optimizers import AdamW

    torch.manual_seed(0)
    model = Decoder(MOE)
    if engine == "ours":
        _sharded(model, "fp32")
        return model, AdamW(_flat_adamw_groups(model), lr=1e-2, amsgrad=True)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(_flat_adamw_groups(model), lr=1e-2, amsgrad=True, foreach=True)


def _batch(step: int) -> torch.Tensor:
    """The whole batch of a step: 12 rows, which 3 and 4 ranks both split evenly."""
    return torch.randint(0, MOE.vocab, (12, SEQ), generator=torch.Generator().manual_seed(step))


def _train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in steps:
        batch = _batch(step)
        rows = len(batch) // world
        mine = batch[rank * rows : (rank + 1) * rows]
        _route(model, mine.numel(), rank * mine.numel(), num_experts=4)
        loss = loss_fn(model(mine), mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def _one_process_run() -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """5 steps of the same training in one process, torch's AdamW on the whole batch."""
    torch.manual_seed(0)
    model = Decoder(MOE)
    opt = torch.optim.AdamW(_flat_adamw_groups(model), lr=1e-2, amsgrad=True, foreach=True)
    losses = []
    for step in range(5):
        batch = _batch(step)
        _route(model, batch.numel(), 0, num_experts=4)
        loss = loss_fn(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, opt


def check_adamw_checkpoint(directory: str, engine: str, phase: str) -> dict[str, Any]:
    """DCP across engines and world sizes: `save` trains steps 0-2 and saves model and
    optimizer; `load` builds `engine` at this world size, loads, checks the optimizer state
    against one process after 3 steps, trains steps 3-4, and checks against one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _engine_model(engine)
    if phase == "save":
        _train_steps(model, opt, range(3))
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
        dist.barrier()
        return {}
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    one_losses, one_model, one_opt = _one_process_run()
    # Every expert gets tokens here: DCP's loader makes state for every parameter (a dry
    # step) and then wants it in the checkpoint, for torch's AdamW as for this one.
    steps = {int(opt.state[p]["step"]) for p in model.parameters()}
    assert steps == {3}, steps
    losses = _train_steps(model, opt, range(3, 5))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(one_losses[3:]), atol=2e-4, rtol=0
    )
    for (name, p), q in zip(model.named_parameters(), one_model.parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), q.detach(), atol=2e-4, rtol=0, msg=name)
        for key, value in one_opt.state[q].items():
            got = opt.state[p][key]
            got = _full(got) if isinstance(got, DTensor) else got
            torch.testing.assert_close(got, value, atol=2e-4, rtol=1e-3, msg=f"{name} {key}")
    return {"losses": losses, "one_process": one_losses[3:]}


# -- Muon under HSDP: each matrix orthogonalized once in the whole mesh --------------------------


def check_muon_hsdp_on_engine(ns_batch_numel: int, replica_owners: bool | str) -> int:
    """8 Linear(256, 256) blocks under fully_shard on a (2, 2) (replicate, shard) mesh with
    Muon's defaults but those given: 2 steps against one process on the full gradients
    (bitwise with one matrix per batch; batched products may round apart); returns this
    rank's matmul FLOPs of the last step, counted by torch's FlopCounterMode (the
    Newton-Schulz products: Muon's other passes are elementwise)."""
    from torch.utils.flop_counter import FlopCounterMode

    import ragged_optimizers._muon as muon_module
    from ragged_optimizers import Muon, ns_flops

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(8)))
    reference = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(8)))
    reference.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kwargs: dict[str, Any] = {"lr": 0.02, "ns_batch_numel": ns_batch_numel}
    opt = Muon(model.parameters(), replica_owners=replica_owners, **kwargs)
    ref_opt = Muon(reference.parameters(), **kwargs)
    original = muon_module.newton_schulz
    flops: list[int] = []

    def counting(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        flops.append(ns_flops(tuple(x.shape), 5))
        return original(x, *args, **kw)

    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 256, generator=gen)).square().mean().backward()
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            ref.grad = _full(p.grad).clone()
        flops.clear()
        muon_module.newton_schulz = counting  # type: ignore[assignment]
        try:
            with FlopCounterMode(display=False) as counter:
                opt.step()
        finally:
            muon_module.newton_schulz = original
        # The profiler's count is the Newton-Schulz count from the shapes it ran on.
        assert counter.get_total_flops() == sum(flops), (counter.get_total_flops(), flops)
        ref_opt.step()
        opt.zero_grad()
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            if ns_batch_numel == 1:
                assert torch.equal(_full(p.detach()), ref.detach())
            else:
                # Batched products may round each bfloat16 Newton-Schulz output apart by one
                # ulp; outputs are at most 1.13 (the singular values' bound), whose ulp is
                # 2**-7, times lr 0.02 (square matrices: no lr scaling), over 2 steps.
                bound = 2 * 0.02 * 2**-7
                torch.testing.assert_close(_full(p.detach()), ref.detach(), atol=bound, rtol=0)
    return int(counter.get_total_flops())


def check_optimizer_state_offload(optimizer: str) -> None:
    """OptimizerStateOffload: state in host copies between steps, steps bitwise unchanged."""
    from ragged_optimizers import AdamW as FlatAdamW

    make = {"torch": torch.optim.AdamW, "flat": FlatAdamW}[optimizer]
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    opts = [make(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    offload = fsdp_engine.OptimizerStateOffload(opts[0])
    gen = torch.Generator().manual_seed(1)
    held: list[torch.Tensor] = []
    for step in range(3):
        x = torch.randn(4, 16, generator=gen)
        for model, opt in zip(models, opts, strict=True):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        states = [[v for s in opt.state.values() for v in s.values()] for opt in opts]
        tensors = [v for v in states[0] if isinstance(v, torch.Tensor)]
        assert offload.num_offloaded == len(tensors) > 0, (offload.num_offloaded, len(tensors))
        # New tensors each step (the moves replace the entries), with the stepped values.
        assert not {id(t) for t in tensors} & {id(t) for t in held}, step
        held = tensors
        for got, want in zip(*states, strict=True):
            if isinstance(want, DTensor):
                got, want = got.to_local(), want.to_local()
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), step
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p.to_local(), q.to_local()), step
    # A state dict taken between steps loads into a fresh optimizer that steps the same.
    saved = copy.deepcopy(opts[0].state_dict())
    offload.remove()
    assert offload.num_offloaded == 0
    opts[0].load_state_dict(saved)
    x = torch.randn(4, 16, generator=gen)
    for model, opt in zip(models, opts, strict=True):
        model(x).square().mean().backward()
        opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())
    expect_error(TypeError, lambda: fsdp_engine.OptimizerStateOffload("adam"), "got 'adam'")  # type: ignore[arg-type]
