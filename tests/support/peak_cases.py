"""The planner's peak memory per rank against the profiler's, for plans applied as printed.

The example decoder (the sizes of tools/validate_step.py's models: a step is mostly
activations and gathered blocks, as a real one is) is described from its shapes; `advise`
plans it at one mesh split, and the code it prints for that plan (`layout_lines`: meshes,
mixed precision, the bound `fully_shard`, the calls) runs on every rank as printed, with
"cuda" read as "cpu". Under expert parallelism the printed comment says where the model's
own code keeps each rank's experts: the example's `expert_parallel` runs there. Then one
AdamW step is measured (the profiler's running sum of allocations plus what was live when
it began, after a step that leaves the memory as every later step finds it) and compared
with `Estimate.memory_bytes`.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, MoE, loss_fn
from parallel import expert_parallel
from planning import decoder_groups
from profiling import peak_live_bytes

from shard_planner import ActivationModel, Candidate, advise
from shard_planner._compute import ComputeModel
from shard_planner._recipe import layout_lines

SEQ, BATCH, TOP_K = 128, 1, 2
# The example's op-by-op code keeps 1.25x (dense) and 1.28x (MoE) the fused kernels' count
# (tests/test_activation_estimate.py measures it).
SCALE = {False: 1.25, True: 1.28}
_EP_COMMENT = "# expert parallelism:"


def _config(moe: bool) -> Config:
    return Config(vocab=256, dim=256, num_heads=4, num_layers=4, hidden=688,
                  num_experts=8 if moe else 0, top_k=TOP_K)  # fmt: skip


def _plan(moe: bool, replicas: int, ep: int, bf16: bool) -> tuple[Candidate, list[str]]:
    """The plan `advise` ranks for this split and its printed code."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    groups = decoder_groups(Decoder(_config(moe)))
    compute_bytes = 2 if bf16 else None
    acts = ActivationModel(SEQ, BATCH, TOP_K if moe else None, scale=SCALE[moe])
    compute = ComputeModel(tokens_per_rank=SEQ * BATCH, top_k=TOP_K, hidden_size=256)
    ranked = advise(
        groups, num_ranks=world, ranks_per_node=world, memory_bytes=2**30, include_all=True,
        activations=acts, expert_groups=(0,), expert_parallel=(ep,), prefetch=(1,),
        reshard_after_forward=(True,), optimizers=("adamw",), reduce_bytes=(4,),
        dense_shard_sizes=(), compute=compute if moe else None, compute_bytes=compute_bytes,
        allow_idle_ranks=True,
    )  # fmt: skip
    (plan,) = [
        c for c in ranked
        if (c.replicate_size, c.estimate.expert_parallel) == (replicas, ep)
        and not c.estimate.checkpointing
    ]  # fmt: skip
    printed = layout_lines(plan, groups, 1, compute_bytes=compute_bytes)
    code = [line.removeprefix("    ") for line in printed[2:] if not line.startswith("note:")]
    return plan, code


def _apply(code: list[str], moe: bool) -> Decoder:
    """Runs the printed code on a fresh model (the EP split where its comment says)."""
    torch.manual_seed(0)
    model = Decoder(_config(moe))
    scope: dict[str, Any] = {"model": model}
    text = "\n".join(code).replace('"cuda"', '"cpu"')
    before, marker, after = text.partition(_EP_COMMENT)
    exec(before, scope)
    if marker:
        expert_parallel(model, scope["ep_mesh"]["ep"])
        exec(marker + after, scope)
    return model


def check_peak_within_10_percent(moe: bool, replicas: int, ep: int, bf16: bool) -> dict[str, Any]:
    """One step's measured peak per rank (the largest rank's) against the plan's estimate."""
    plan, code = _plan(moe, replicas, ep, bf16)
    model = _apply(code, moe)
    if moe:  # every expert gets the same number of tokens: each rank's work is the plan's
        tokens_seen = SEQ * BATCH * ep  # under EP a MoE runs its whole ep group's tokens
        slots = torch.arange(tokens_seen * TOP_K) % 8
        for block in model.layers:
            assert isinstance(block.mlp, MoE)
            block.mlp.forced_choice = slots.view(tokens_seen, TOP_K)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))

    def step() -> None:
        loss_fn(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    step()
    gc.collect()
    measured = peak_live_bytes(step, include_live=True, lead_in=step)
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, measured)
    est = plan.estimate
    ratio = est.memory_bytes / max(peaks)
    assert 0.9 <= ratio <= 1.1, (ratio, est.memory_bytes, peaks, est.peak, code)
    return {
        "split": (plan.replicate_size, plan.shard_size, est.expert_parallel),
        "estimate_mb": round(est.memory_bytes / 1e6, 2),
        "measured_mb": round(max(peaks) / 1e6, 2),
        "ratio": round(ratio, 3),
        "phase": est.peak.phase,
    }
