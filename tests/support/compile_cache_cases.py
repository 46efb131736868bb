"""Compiled steps over uneven RaggedShard parameters, on ranks that share one inductor cache.

torchrun's ranks share torch.compile's on-disk caches by default (one TORCHINDUCTOR_CACHE_DIR
per user), and on CPU they share one device too. Each rank here holds pieces of other shapes
(one of them empty); a rank must never run code compiled for another rank's shapes. Each run
happens in fresh processes (a new RankPool), so the only thing one run hands the next is the
cache on disk, as between two torchrun launches.

Steps:
- "function": a torch.compile'd SGD-with-momentum update whose arguments are the DTensors
  themselves (torch traces through the DTensor subclass);
- "adamw8bit": ragged_optimizers.AdamW8bit(fused="compiled") (inductor compiles the block
  update on each rank's local blocks);
- "torchao": torchao's AdamW8bit (one compiled step per parameter, over DTensors of its own
  8-bit state subclass).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

# Rows of each rank's piece (3 ranks): uneven, with an empty piece and a whole-block layout
# for the 8-bit optimizers (blocks of 32 rows; torchao quantizes pieces of >= 4096 elements).
SHAPES = [(160, 64), (96, 64), (64, 64)]
ROWS = [(64, 96, 0), (32, 32, 32), (0, 32, 32)]
STEPS = 3


def _params(mesh: Any) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import distribute_tensor

    from ragged_placement import RaggedShard

    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(
            distribute_tensor(torch.randn(shape, generator=gen), mesh, [RaggedShard((0,), rows)])
        )
        for shape, rows in zip(SHAPES, ROWS, strict=True)
    ]


def _set_grads(params: list[torch.nn.Parameter], mesh: Any, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    from ragged_placement import RaggedShard

    gen = torch.Generator().manual_seed(100 + step)
    for p, shape, rows in zip(params, SHAPES, ROWS, strict=True):
        full = torch.randn(shape, generator=gen)
        p.grad = distribute_tensor(full, mesh, [RaggedShard((0,), rows)])


def _momentum_update(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor) -> None:
    buf.mul_(0.9).add_(grad)
    p.sub_(buf * 1e-2 + p * 1e-3)


def compiled_steps(steps: list[str], cache: str) -> dict[str, dict[str, torch.Tensor]]:
    """Runs each of `steps` with the inductor cache at `cache` (one folder for all ranks) or,
    where `cache` has "{rank}" in it, a folder per rank. Returns, per step, this rank's pieces
    of the parameters and of every state tensor."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.format(rank=dist.get_rank())
    return {step: _compiled_step(step) for step in steps}


def _compiled_step(step: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = _params(mesh)
    if step == "function":
        update = torch.compile(_momentum_update, fullgraph=True)
        bufs = [torch.zeros_like(p) for p in params]
        for i in range(STEPS):
            _set_grads(params, mesh, i)
            with torch.no_grad():
                for p, buf in zip(params, bufs, strict=True):
                    update(p, p.grad, buf)
        states = {f"{i}.buf": b for i, b in enumerate(bufs)}
    else:
        if step == "adamw8bit":
            from ragged_optimizers import AdamW8bit

            opt: torch.optim.Optimizer = AdamW8bit(params, lr=1e-2, fused="compiled")
        elif step == "torchao":
            from torchao.optim import AdamW8bit as TorchaoAdamW8bit

            opt = TorchaoAdamW8bit(params, lr=1e-2, block_size=256)
        else:
            raise ValueError(f"step must be 'function', 'adamw8bit' or 'torchao', got {step!r}")
        for i in range(STEPS):
            _set_grads(params, mesh, i)
            opt.step()
        states = {
            f"{i}.{key}": value
            for i, p in enumerate(params)
            for key, value in opt.state[p].items()
            if isinstance(value, torch.Tensor)
        }
    out = {f"{i}": p.detach() for i, p in enumerate(params)} | states
    pieces = {}
    for name, value in out.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if hasattr(local, "dequantize"):  # torchao's 8-bit state
            local = local.dequantize()
        pieces[name] = local.detach().clone()
    return pieces
