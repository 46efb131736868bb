"""Host work of a training step, on torch's fake process group (one process plays rank 0).

Run by test_overhead.py in a fresh interpreter: `python -c "import overhead_cases as c;
c.main('<check>')"`. A check that crashes the interpreter (reading freed memory) fails the
test through the exit status instead of taking pytest down.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, MoE, loss_fn
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_engine
from fsdp_engine import fully_shard
from ragged_placement._compat import _installed

WORLD = 8
OURS = ("fsdp_engine", "dbuffer", "ragged_placement")  # our packages' source files
_BASE = {"vocab": 64, "dim": 16, "num_heads": 2, "num_layers": 2, "hidden": 32}


def _model(num_experts: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Decoder(Config(**_BASE, num_experts=num_experts))
    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _route(model: torch.nn.Module, num_experts: int, unused: set[int], tokens: int) -> None:
    """Token t goes to experts t and t + 1 among the used ones (every used one gets some)."""
    used = torch.tensor([e for e in range(num_experts) if e not in unused])
    position = torch.arange(tokens) % len(used)
    choice = torch.stack([used[position], used[(position + 1) % len(used)]], 1)
    for layer in model.layers:  # type: ignore[union-attr]
        assert isinstance(layer.mlp, MoE)
        layer.mlp.forced_choice = choice


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, profile: Any = None) -> None:
    tokens = torch.randint(0, _BASE["vocab"], (2, 16), generator=torch.Generator().manual_seed(1))
    if profile is not None:
        profile.enable()
    loss_fn(model(tokens), tokens).backward()
    if profile is not None:
        profile.disable()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad()


def check_calls_do_not_grow_with_parameters() -> None:
    """Forward + backward run the same Python calls in our packages at 8 and 32 experts per
    block (3 parameters each), and our code makes one more call per added parameter (builtins
    counted too): the constructor of its reduced-gradient DTensor, which FSDP2 calls per
    parameter as well. The engine's host work follows the groups, not the parameters."""
    counts, made, num_params = {}, {}, {}
    for num_experts in (8, 32):
        model, opt = _model(num_experts)
        num_params[num_experts] = sum(1 for _ in model.parameters())
        _route(model, num_experts, set(), tokens=32)
        for _ in range(3):
            _step(model, opt)
        profile = cProfile.Profile()
        _step(model, opt, profile)
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        counts[num_experts] = sum(
            count for (path, _, _), (count, *_) in stats.items() if any(p in path for p in OURS)
        )
        made[num_experts] = sum(
            value[0] if isinstance(value, tuple) else value
            for *_, callers in stats.values()
            for (path, _, _), value in callers.items()
            if any(p in path for p in OURS)
        )
    assert counts[8] == counts[32], counts
    added = num_params[32] - num_params[8]
    assert made[32] - made[8] == added, (made, added)
    assert 0 < counts[8] < 2000, counts  # a few hundred per group


def check_varying_unused_experts_propagate_nothing() -> None:
    """With a different set of experts unused in every step (their parameters get no
    gradient: the optimizer's lists change), a step decides every op from cache once each
    parameter was seen."""
    num_experts = 16
    model, opt = _model(num_experts)
    decisions = _installed[0].decisions  # type: ignore[attr-defined]
    _route(model, num_experts, set(), tokens=32)
    _step(model, opt)
    seen = decisions.num_propagations
    for step in range(6):
        _route(model, num_experts, {step, (3 * step + 5) % num_experts}, tokens=32)
        _step(model, opt)
    assert decisions.num_propagations == seen, (seen, decisions.num_propagations)


def check_stale_full_view(mode: str) -> None:
    """A reference to an unsharded parameter kept past its group's reshard.

    With DBUFFER_CHECK_FREED=1 reading it raises a clear error. By default a backward that
    needs what autograd saved from it, while the group is resharded (here: a group told not
    to gather in backward), raises autograd's error instead of reading freed memory.
    """
    model, _ = _model(0)
    block = model.layers[0]  # type: ignore[index]
    kept: list[torch.Tensor] = []
    handle = block.attn.wqkv.register_forward_pre_hook(lambda m, _: kept.append(m.weight))
    tokens = torch.randint(0, _BASE["vocab"], (2, 16))
    if mode == "debug":
        assert os.environ.get("DBUFFER_CHECK_FREED") == "1"
        loss_fn(model(tokens), tokens).backward()
        handle.remove()
        stale = kept[0]
        assert isinstance(block.attn.wqkv.weight, DTensor)  # the sharded one is registered again
        expect_error(RuntimeError, lambda: stale.sum(), "is freed")
        return
    block.set_unshard_in_backward(False)  # wrong for this block: its backward reads weights
    loss = loss_fn(model(tokens), tokens)
    expect_error(RuntimeError, loss.backward, "modified by an inplace operation")


def main(check: str, *args: str) -> None:
    sys.setrecursionlimit(10_000)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    assert fsdp_engine.__version__
    globals()[check](*args)
    dist.destroy_process_group()
    print("ok")
