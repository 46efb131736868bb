"""Tensor and expert parallelism for the example decoder, applied before fully_shard.

`tensor_parallel(model, tp_mesh)` is the Megatron plan, written with torch's own parallel
styles: in each block the fused q/k/v projection and the MLP's w1/w3 are column-parallel
(each tensor-parallel rank computes whole heads and a slice of the hidden units), the output
projections row-parallel (one all-reduce each). Norms, the embedding and the head stay
replicated. `expert_parallel(model, ep_mesh)` keeps each expert-parallel rank's share of every
MoE's experts; the tokens of the ep group are gathered before the MoE and its outputs summed
back (all-gather / all-reduce, which gloo has; an all-to-all dispatch would move less).

Both run before `fully_shard`, which then shards each rank's pieces over the data-parallel
axes (see the README's "Tensor and expert parallelism").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from model import Decoder, ExpertList, GroupedExperts, MoE, SwiGLU
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)


def tensor_parallel(model: Decoder, tp_mesh: DeviceMesh) -> None:
    """Shards every block's attention and dense MLP over `tp_mesh` (Megatron style)."""
    size = tp_mesh.size()
    for index, block in enumerate(model.blocks):
        mlp = block.mlp
        if not isinstance(mlp, SwiGLU):
            raise ValueError("tensor_parallel shards dense MLPs; use expert_parallel for MoE")
        heads, hidden = block.attn.num_heads, mlp.w1.out_features
        plan: dict[str, ParallelStyle] = {
            name: ColwiseParallel() for name in ("attn.wqkv", "mlp.w1", "mlp.w3")
        }
        plan.update({name: RowwiseParallel() for name in ("attn.wo", "mlp.w2")})
        if heads % size or hidden % size:
            raise ValueError(
                f"block {index}: {heads} heads and {hidden} hidden units must both divide by "
                f"the tensor-parallel size {size}"
            )
        parallelize_module(block, tp_mesh, plan)


def expert_parallel(model: Decoder, ep_mesh: DeviceMesh) -> None:
    """Keeps this rank's experts of every MoE: num_experts / ep_mesh.size() of them.

    Fused experts become Shard(0) DTensors over `ep_mesh`; separate experts keep only this
    rank's modules. Each MoE then sees the tokens of the whole ep group.
    """
    size, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    for index, block in enumerate(model.blocks):
        moe = block.mlp
        if not isinstance(moe, MoE):
            raise ValueError("expert_parallel needs MoE blocks (train.py --moe N)")
        experts = moe.experts
        num_experts = len(experts)
        if num_experts % size:
            raise ValueError(
                f"block {index}: {num_experts} experts do not divide by the expert-parallel "
                f"size {size}"
            )
        per_rank = num_experts // size
        first = rank * per_rank
        if isinstance(experts, GroupedExperts):
            for name in ("w1", "w3", "w2"):
                full = getattr(experts, name).detach()
                sharded = nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)]))
                experts.register_parameter(name, sharded)
        else:
            experts = moe.experts = ExpertList(list(experts)[first : first + per_rank])
        experts.first_expert = first
        moe.register_forward_pre_hook(lambda _m, args, g=group: (gather_rows(args[0], g),))
        moe.register_forward_hook(lambda _m, _a, out, g=group: sum_and_take_rows(out, g))


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward sums the gradients and keeps our rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sum_rows_mine(grad.contiguous(), ctx.group), None


class _SumAndTakeRows(torch.autograd.Function):
    """Sums over `group` and keeps this rank's rows; backward gathers the rows' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _sum_rows_mine(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _sum_rows_mine(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    total = x.clone()
    dist.all_reduce(total, group=group)
    rows = x.shape[0] // dist.get_world_size(group)
    start = dist.get_rank(group) * rows
    return total[start : start + rows]


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The rows (dim 0) of every rank of `group`, in rank order; differentiable."""
    out: torch.Tensor = _GatherRows.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def sum_and_take_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` summed over `group`, this rank's share of its rows; differentiable."""
    mine: torch.Tensor = _SumAndTakeRows.apply(x, group)  # type: ignore[no-untyped-call]
    return mine
