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
