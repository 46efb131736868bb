"""Both optimizers on a fully_shard model, on every rank of a RankPool.

Each step the engine computes the gradients (forward and backward on this rank's rows, then
its reduce-scatter); the optimizer then updates the RaggedShard parameters. The reference is
the same optimizer in one process on full tensors, given the full gradients of that step: the
sharded update must equal it bitwise. Gradients of data-parallel training differ from one
process's by summation order, so the loss curve is compared with a one-process run separately,
within a tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, loss_fn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from train import make_optimizer

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


def check_engine_training(optimizer: str) -> dict[str, Any]:
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
        fully_shard(layer, mesh=mesh, block_rows=block_rows)
    fully_shard(model, mesh=mesh, block_rows=block_rows)
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


def _route_around_last_expert(model: torch.nn.Module, tokens: int, first_token: int) -> None:
    """Every token to experts 0-2 (top 2) by its index in the whole batch: the last expert
    gets no gradient on any rank, and each token goes where it goes in one process."""
    for layer in model.layers:  # type: ignore[union-attr]
        first = (torch.arange(tokens) + first_token) % 3
        layer.mlp.forced_choice = torch.stack([first, (first + 1) % 3], 1)


def check_flat_adamw_on_engine(kind: str, precision: str) -> dict[str, Any]:
    """ragged_optimizers.AdamW against torch.optim.AdamW(foreach=True) on one sharded model.

    Two copies of one sharded model: parameters and every state tensor equal bit for bit
    after each of 5 steps. In fp32 also close to one process (torch's AdamW on the whole
    batch); in bf16 mixed precision AdamW turns a gradient's rounding near zero into a whole
    step (lr) for that element, so there the bitwise check is the one.
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
    kwargs = {"lr": 1e-2, "amsgrad": True}
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
                _route_around_last_expert(model, rows.numel(), first_token)
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
