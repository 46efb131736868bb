"""What the engine's case modules share: the model, its batches, a sharded model, steps.

The reference trains one process on the full batch; each rank trains on its own slice of
every batch (`rows_of_rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, loss_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from fsdp_engine import CPUOffloadPolicy, fully_shard

BATCH_PER_RANK = 2


SEQ = 9


def _config(variant: str) -> Config:
    if variant == "moe":
        return Config(num_experts=16, top_k=2)
    if variant == "tied":
        return Config(tie_embeddings=True)
    return Config()


def make_mesh(variant: str) -> DeviceMesh:
    world = dist.get_world_size()
    if variant == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def make_model(variant: str) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(_config(variant))
    if variant == "frozen":
        model.layers[0].attn_norm.weight.requires_grad_(False)
        model.norm.weight.requires_grad_(False)
    if variant == "unused":
        model.layers[1].unused = nn.Linear(3, 5)  # registered, never called
    if variant == "moe":
        # In float64: a top-2 router's near-ties flip on fp32 rounding noise (the order in
        # which ranks' gradients are summed), and one flipped token moves an expert far
        # beyond fp32 tolerances after a few steps (measured: 2.7e-4 at W=3). In float64
        # that noise is 1e-16 and the comparison is exact to float64's defaults.
        model.double()
    return model


def make_batches(steps: int, micro: int) -> list[list[torch.Tensor]]:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    vocab = Config().vocab
    return [
        [
            torch.randint(0, vocab, (world * BATCH_PER_RANK, SEQ), generator=gen)
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def rows_of_rank(batch: torch.Tensor, variant: str) -> torch.Tensor:
    rank = dist.get_rank()
    return batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]


def sharded_model(engine: str, seed: int) -> tuple[Decoder, torch.optim.Optimizer]:
    """A decoder sharded by `engine`: "ours" or "fsdp2", "+offload" for CPUOffloadPolicy."""
    torch.manual_seed(seed)
    model = Decoder(Config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    name, _, offload = engine.partition("+")
    shard: Callable[..., Any] = fully_shard if name == "ours" else torch_fully_shard
    kwargs: dict[str, Any] = {"mesh": mesh}
    if offload:  # FSDP2 cannot pin without an accelerator
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=name == "ours")
    for layer in model.layers:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        tokens = rows_of_rank(batch, "dense")
        loss_fn(model(tokens), tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")
