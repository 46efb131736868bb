"""The engine follows a plan from shard_planner.advise: the layout it prints, applied as is.

A small MoE decoder's groups are described from its shapes (as a preset describes a real
model), `advise` ranks the mesh splits at each group granularity and expert-parallel degree,
and the `fully_shard` calls it prints for a plan are run on the model (under expert
parallelism after the example's `expert_parallel` kept each rank's experts). What each rank
then holds must equal the plan's estimate byte for byte: parameters, gradients, AdamW state,
the largest gathered group.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, MoE, SwiGLU, loss_fn
from parallel import expert_parallel
from planning import decoder_groups
from torch.distributed.device_mesh import init_device_mesh

from fsdp_engine import FSDPModule, fully_shard
from shard_planner import Candidate, GroupSpec, advise, estimate
from shard_planner._compute import ComputeModel
from shard_planner._expert_parallel import expert_groups_under_ep
from shard_planner._granularity import fully_shard_calls, split_experts
from shard_planner._recipe import prefetch_lines

NUM_EXPERTS = 8


def _model(dense_first: bool = False) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(Config(num_experts=NUM_EXPERTS, num_layers=3, dim=24, hidden=40))
    if dense_first:  # as DeepSeek-V3: dense blocks, then MoE blocks
        model.blocks[0].mlp = SwiGLU(24, 40)
    return model


def _apply(candidate: Candidate, groups: list[GroupSpec]) -> tuple[Decoder, list[str]]:
    dense = candidate.estimate.dense_shard_size
    model = _model(dense_first=dense is not None)
    replicas, shards = candidate.replicate_size, candidate.shard_size
    ep = candidate.estimate.expert_parallel
    mesh = init_device_mesh("cpu", (replicas, shards) if replicas > 1 else (shards,))
    grouped = split_experts(groups, candidate.expert_groups)
    assert grouped is not None
    scope: dict[str, Any] = {"model": model}
    if ep > 1:  # as the CLI says: keep this rank's experts over 'ep', shard them over 'dp'
        assert replicas == 1, "an HSDP mesh under EP is not built here"
        grid = init_device_mesh("cpu", (shards // ep, ep), mesh_dim_names=("dp", "ep"))
        expert_parallel(model, grid["ep"])
        grouped = tuple(expert_groups_under_ep(grouped, ep)[0])
        scope["experts_mesh"] = grid["dp"]
    if dense is not None:  # as the CLI says: (copies, dense) HSDP for each dense block
        scope["dense_mesh"] = init_device_mesh(
            "cpu", (replicas * shards // dense, dense), mesh_dim_names=("replicate", "shard")
        )
    code = fully_shard_calls(
        grouped,
        experts_mesh="experts_mesh" if ep > 1 else None,
        dense_mesh="dense_mesh" if dense is not None else None,
    )
    reshard = candidate.estimate.reshard_after_forward
    bound = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=reshard)
    made: list[torch.nn.Module] = []

    def record(module: Any, **kwargs: Any) -> Any:  # the recipe's wrapper (setup_lines)
        made.append(module[0] if isinstance(module, list) else module)
        return bound(module, **kwargs)

    scope.update(fully_shard=record, made=made)
    # The recipe's prefetch code, two groups deep (the plans here ask for one or two).
    code += prefetch_lines(2)
    exec("\n".join(code), scope)
    return model, code


def check_engine_follows_advised_plans() -> list[dict[str, Any]]:
    world = dist.get_world_size()
    groups = decoder_groups(_model())
    results = []
    for k in (0, 2):
        candidates = advise(groups, num_ranks=world, ranks_per_node=world, memory_bytes=2**30,
                            expert_groups=(k,), min_shard_size=2)  # fmt: skip
        assert candidates and all(c.expert_groups == k for c in candidates)
        for candidate in candidates:
            results.append(_check(candidate, groups))
    # Expert parallelism of 2 (priced with tokens and top_k), on the one split it allows
    # here without HSDP: experts held by 2 ranks each, sharded over the other 2.
    compute = ComputeModel(tokens_per_rank=18, top_k=2, hidden_size=24)
    candidates = advise(groups, num_ranks=world, ranks_per_node=world, memory_bytes=2**30,
                        expert_parallel=(2,), compute=compute, min_shard_size=world,
                        prefetch=(1,))  # fmt: skip
    assert {c.estimate.expert_parallel for c in candidates} == {2}, candidates
    results += [_check(candidate, groups) for candidate in candidates]
    return results


def _check(candidate: Candidate, groups: list[GroupSpec]) -> dict[str, Any]:
    model, code = _apply(candidate, groups)
    est = candidate.estimate
    # A list group (`[model.norm, model.head]`) is one state on each of its modules.
    states = {
        id(m._fsdp_engine_state): m._fsdp_engine_state
        for m in model.modules()
        if isinstance(m, FSDPModule)
    }.values()
    buffers = [b for s in states if s.group is not None for b in s.group.buffers]
    # The prefetch code: each group's targets are the next two / previous two groups in
    # the model's module order, one state each.
    order = list(dict.fromkeys(
        m._fsdp_engine_state for m in model.modules() if isinstance(m, FSDPModule)
        and m is not model
    ))  # fmt: skip
    for i, state in enumerate(order):
        assert state.config.forward_prefetch == tuple(order[i + 1 : i + 3]), (i, code)
        assert state.config.backward_prefetch == tuple(order[max(i - 2, 0) : i][::-1]), i
    # One group per planned group, each one DBuffer (one dtype): as the plan counts them.
    assert len(buffers) == len(split_experts(groups, candidate.expert_groups) or ()), code
    assert sum(b.local.nbytes for b in buffers) == est.param_bytes, (code, est)
    # The largest gather: S x W of a group (W / e for experts under expert parallelism).
    assert max(b.shard_size * b.layout.world_size for b in buffers) * 4 == est.unsharded_bytes
    ep = est.expert_parallel
    if ep > 1:  # the experts' groups gather over the W / e ranks holding the same experts
        assert sorted({b.layout.world_size for b in buffers}) == [candidate.shard_size // ep,
                                                                 candidate.shard_size]  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    # Every expert gets tokens on every rank: an expert group gathers (a collective) when one
    # of its experts runs, so each rank must run each group, as with any FSDP group.
    # Under EP a MoE runs the tokens of its whole ep group (gathered before it).
    slots = torch.arange(tokens.numel() * ep * 2) % NUM_EXPERTS
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.forced_choice = slots.view(tokens.numel() * ep, 2)
    loss = loss_fn(model(tokens), tokens)
    # Between forward and backward: the groups kept gathered (reshard_after_forward=False)
    # are what the plan counts for that moment.
    if not est.reshard_after_forward:
        held = sum(b.shard_size * b.layout.world_size * 4 for b in buffers if b.is_unsharded)
        assert held == est.prefetch_unsharded_bytes, (held, est.prefetch_unsharded_bytes)
    loss.backward()
    opt.step()
    assert sum(b.local_grad.nbytes for b in buffers) == est.grad_bytes
    state = sum(
        v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
        for s in opt.state.values() for key, v in s.items() if key != "step"
    )  # fmt: skip
    shard_rank = dist.get_rank() % candidate.shard_size
    assert state == est.optimizer_bytes_by_rank[shard_rank], (state, est.optimizer_bytes_by_rank)
    return {
        "split": (candidate.replicate_size, candidate.shard_size),
        "expert_groups": candidate.expert_groups,
        "expert_parallel": ep,
        "reshard_after_forward": est.reshard_after_forward,
        "dense_shard_size": est.dense_shard_size,
        "param_bytes": est.param_bytes,
        "memory_bytes": est.memory_bytes,
    }


def check_engine_follows_a_dense_sub_mesh_plan() -> dict[str, Any]:
    """A MoE model whose first block is dense, that block sharded over 2 of the 4 ranks."""
    world = dist.get_world_size()
    groups = decoder_groups(_model(dense_first=True))
    est = estimate(groups, shard_size=world, ranks_per_node=world, dense_shard_size=2)
    assert est.all_reduce_bytes > 0  # the dense block's two copies all-reduce
    return _check(Candidate(1, world, est, est.memory_bytes), groups)
