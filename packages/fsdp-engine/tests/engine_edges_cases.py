"""What FSDP2 defines around training, run on every rank of a RankPool: integer frozen
parameters, parameters assigned after fully_shard, ranks that built different models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_engine import fully_shard

ENGINES: dict[str, Callable[..., Any]] = {"ours": fully_shard, "fsdp2": torch_fully_shard}


class Gather(nn.Module):
    """A linear layer whose output columns are picked by a frozen integer parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.order = nn.Parameter(torch.tensor([5, 0, 3, 1, 4, 2]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, self.order]


def check_integer_frozen_parameter(mixed: bool) -> dict[str, list[float]]:
    """Trains 3 steps: ours equals one process (and FSDP2, on a torch whose FSDP2 shards
    integer parameters: 2.10's wraps them in a Parameter that requires grad and fails)."""
    policy = MixedPrecisionPolicy()
    if mixed:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses: dict[str, list[float]] = {}
    for engine in ("one process", *ENGINES):
        torch.manual_seed(0)
        model = nn.Sequential(Gather(), Gather())
        if engine != "one process":
            try:
                for block in model:
                    ENGINES[engine](block, mp_policy=policy)
                ENGINES[engine](model, mp_policy=policy)
            except RuntimeError as exc:  # FSDP2 on torch 2.10
                assert engine == "fsdp2" and "floating point" in str(exc), exc
                continue
        elif mixed:
            model.to(torch.bfloat16)  # what the gathered parameters compute in
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)  # the same rows on every rank
        losses[engine] = []
        for _ in range(3):
            rows = torch.randn(4, 6, generator=gen)
            loss = model(rows.to(torch.bfloat16) if mixed and engine == "one process" else rows)
            loss = loss.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[engine].append(loss.item())
        order = model[1].order
        assert order.dtype == torch.int64 and not order.requires_grad, engine
        full = order.full_tensor() if engine != "one process" else order
        assert full.tolist() == [5, 0, 3, 1, 4, 2], engine
        assert order.grad is None, engine
    # bf16: one process keeps bf16 weights (rounded at each step), ours fp32 ones cast to bf16
    # for compute: a few bf16 ulps (2**-8 relative) apart after 3 steps. fp32: the same sums
    # in another order, float32 rounding.
    tolerance = {"rtol": 4 * 2**-8, "atol": 1e-3} if mixed else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(losses["ours"], losses["one process"], **tolerance)
    if "fsdp2" in losses:
        torch.testing.assert_close(losses["ours"], losses["fsdp2"], rtol=1e-5, atol=1e-6)
    return losses


class WeightNorm(nn.Module):
    """FSDP2's own test model: a parameter made from the sharded weights after fully_shard."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1)
            norm = norm + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def check_parameter_assigned_before_first_forward() -> None:
    """Assigned after fully_shard and before the first forward: adopted, as FSDP2 does;
    assigned after it: refused by name."""
    torch.manual_seed(0)
    reference = WeightNorm()
    losses = {}
    inputs = torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    for engine, shard in ENGINES.items():
        model = WeightNorm()
        model.load_state_dict(reference.state_dict())
        shard(model.layer1)
        shard(model.layer2)
        shard(model)
        model.init_weight_norm()
        loss = model(inputs)
        loss.backward()
        losses[engine] = loss.item()
        assert model.weight_norm.grad is not None, engine
        if engine == "ours":
            model.weight_norm = nn.Parameter(torch.zeros(3))
            try:
                model(inputs)
            except RuntimeError as exc:
                assert "parameter 'weight_norm' was replaced" in str(exc), exc
            else:
                raise AssertionError("a parameter assigned after the first forward was taken")
    reference.init_weight_norm()
    expected = reference(inputs).item()
    assert abs(losses["ours"] - expected) < 1e-5, (losses, expected)
    assert abs(losses["fsdp2"] - expected) < 1e-5, (losses, expected)


def check_different_models_are_named() -> str:
    """Rank 1 builds a wider last layer: every rank raises, naming the tensor and shapes."""
    torch.manual_seed(0)
    width = 5 if dist.get_rank() == 1 else 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, width))
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    try:
        model(torch.randn(2, 3))
    except ValueError as exc:
        message = str(exc)
        expected = "'1.weight' of shape (4, 4) (torch.float32) on rank 0 but '1.weight' of shape"
        assert expected in message and "(5, 4)" in message, message
        dist.barrier()  # the ranks are still in step: the check's collectives paired up
        return message
    raise AssertionError("ranks with different models trained")


def check_out_of_order_calls() -> None:
    """fully_shard on the root, then on a block: the error says to call it bottom-up."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    fully_shard(model)
    try:
        fully_shard(model[0])
    except ValueError as exc:
        assert "'weight' is already sharded" in str(exc), exc
        assert "call it bottom-up: each block, then the root" in str(exc), exc
    else:
        raise AssertionError("a block sharded after its root was taken")
