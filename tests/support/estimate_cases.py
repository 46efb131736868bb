"""shard_planner.estimate against what DBuffer and the optimizers allocate and send."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from ragged_optimizers import AdamW8bit, Muon
from ragged_placement import CommCounter
from shard_planner import estimate
from shard_planner._presets import parse_model

MODEL = {
    "name": "small",
    "groups": [
        {"name": "embed", "tensors": [{"name": "embed.weight", "shape": [96, 64]}]},
        {
            "name": "layers.{i}",
            "indices": [0, 2],
            "tensors": [
                {"name": "wqkv", "shape": [192, 64]},
                {"name": "wo", "shape": [64, 64]},
                {"name": "norm", "shape": [64]},
                {"name": "w1", "shape": [160, 64]},
                {"name": "w2", "shape": [64, 160]},
                {"name": "odd", "shape": [37, 5]},
            ],
        },
        {
            "name": "final",
            "tensors": [
                {"name": "norm", "shape": [64]},
                {"name": "lm_head.weight", "shape": [96, 64]},
            ],
        },
    ],
}


def _optimizer(name: str, params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in params])
    if name == "sgd":
        return torch.optim.SGD([p for _, p in params], lr=0.1, momentum=0.9)
    if name == "adamw8bit":
        return AdamW8bit(params)
    matrices = [(n, p) for n, p in params if p.dim() >= 2 and "embed" not in n and "head" not in n]
    rest = [(n, p) for n, p in params if (n, p) not in matrices]
    return Muon([{"params": matrices}, {"params": rest, "use_muon": False}])


def _local_bytes(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).nbytes


def check_estimate_matches(mode: str, optimizer: str, reduce_bf16: bool = False) -> dict[str, Any]:
    world = dist.get_world_size()
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2))
        shard_axis, replicate_axis, shards, replicas = 1, 0, world // 2, 2
    else:
        mesh = init_device_mesh("cpu", (world,))
        shard_axis, replicate_axis, shards, replicas = 0, None, world, 1
    block_rows = 32 if optimizer == "adamw8bit" else 1
    groups = parse_model(json.dumps(MODEL)).groups
    est = estimate(
        groups,
        shard_size=shards,
        replicate_size=replicas,
        block_rows=block_rows,
        optimizer=optimizer,
        grad_bytes=2 if reduce_bf16 else 4,  # the reduce dtype
        allow_idle_ranks=True,  # as the DBuffers below: small groups may leave ranks idle
    )
    reduce_dtype = torch.bfloat16 if reduce_bf16 else None
    gen = torch.Generator().manual_seed(0)
    buffers = [
        DBuffer(
            [(e.name, torch.randn(e.shape, generator=gen)) for e in g.entries],
            mesh,
            shard_axis=shard_axis,
            replicate_axis=replicate_axis,
            block_rows=block_rows,
        )
        for g in groups
    ]
    assert sum(b.local.nbytes for b in buffers) == est.param_bytes
    with CommCounter() as gathers:
        for b in buffers:
            b.unshard().wait()
    assert gathers.bytes_sent == gathers.bytes_received == est.all_gather_bytes // 2
    for b in buffers:
        for name in b.names:
            b.full_grad(name).fill_(1.0)
        b.reshard()
    with CommCounter() as reduces:
        for b in buffers:
            b.reduce_scatter(op="avg", reduce_dtype=reduce_dtype).wait()
    # The estimate describes a reduce-scatter, (W-1) S b per group. On gloo DBuffer
    # all-reduces the W S-element gradient buffer in place instead (gloo's own reduce-scatter
    # is that all-reduce, on a clone), which the counter counts as W S b.
    if shards > 1:
        assert reduces.bytes_sent * (shards - 1) == est.reduce_scatter_bytes * shards, (
            reduces.bytes_sent,
            est,
        )
    else:
        assert reduces.bytes_sent == est.reduce_scatter_bytes == 0, (reduces.bytes_sent, est)
    # The sharded gradients stay fp32 with a bf16 reduce (the estimate counted them at the
    # reduce dtype before: half of what is allocated).
    assert sum(b.local_grad.nbytes for b in buffers) == est.grad_bytes
    with CommCounter() as all_reduces:
        for b in buffers:
            if b.replicate_axis is not None:
                b.all_reduce(op="avg", reduce_dtype=reduce_dtype).wait()
    assert all_reduces.bytes_sent == est.all_reduce_bytes
    params = []
    for b in buffers:
        for name in b.names:
            param = nn.Parameter(b.sharded(name))
            param.grad = b.sharded_grad(name)
            params.append((name, param))
    opt = _optimizer(optimizer, params)
    opt.step()
    state = sum(
        _local_bytes(v)
        for s in opt.state.values()
        for k, v in s.items()
        if k != "step" and isinstance(v, torch.Tensor)
    )
    shard_rank = mesh.get_local_rank(shard_axis)
    assert state == est.optimizer_bytes_by_rank[shard_rank], (state, est.optimizer_bytes_by_rank)
    return {"optimizer_bytes": state, "param_bytes": est.param_bytes}
