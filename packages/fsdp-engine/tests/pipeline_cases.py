"""fully_shard under torch's pipeline parallelism, run on every rank of a RankPool.

Each pipeline stage is a few residual blocks, each block and the stage `fully_shard`ed over the
stage's data-parallel axis, driven by a `torch.distributed.pipelining` schedule. The schedules
find our stages with `isinstance(stage, torch.distributed.fsdp.FSDPModule)` and hold gradient
sync off across micro-batches, then reduce once: through `finalize_backward` on torch 2.15,
through `fully_shard.state(stage)` before. One process trains the unsplit model on the whole
batch with the same loss; every step's gradients and the final parameters must agree.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from rank_pool import expect_error
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from fsdp_engine import clip_grad_norm_, fully_shard
from fsdp_engine._state import states_under

DIM, NUM_EXPERTS, TOP_K = 8, 4, 2
BLOCKS_PER_STAGE, ROWS_PER_REPLICA, NUM_MICROBATCHES, STEPS = 2, 8, 4, 2
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,  # split backward (dI, then dW)
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
}
STAGES_PER_RANK = {"interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv_zero_bubble": 2}
# A split backward finds the weights it differentiates by `stage.parameters()` before the
# backward's gathers run: with the blocks resharded after forward it finds the sharded ones,
# which the graph never used, and no weight gets a gradient (FSDP2: silently zero, measured
# on torch 2.13 and 2.15). So these schedules keep the blocks gathered (as torchtitan does
# under pipeline parallelism).
SPLIT_BACKWARD = {"interleaved_zero_bubble", "zbv_zero_bubble"}


class Experts(nn.Module):
    """Top-k routed experts (one nn.Linear each); a rank's tokens may skip some experts."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(NUM_EXPERTS))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> Any:
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, NUM_EXPERTS) if moe else None
        self.experts = Experts() if moe else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.relu(self.linear(x))
        if self.router is None or self.experts is None:
            return x
        weights, chosen = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        return x + self.experts(x, weights, chosen)


class Stage(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _stage_indices(schedule: str, pp_rank: int, pp: int) -> list[int]:
    per_rank = STAGES_PER_RANK.get(schedule, 1)
    if schedule == "zbv_zero_bubble":  # V: rank r runs stage r down and stage 2pp-1-r back
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]  # looped


def _batches(dp: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (dp * ROWS_PER_REPLICA, DIM)

    def draw() -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=dtype)

    return [(draw(), draw()) for _ in range(STEPS)]


def check_pipeline(
    schedule: str, pp: int, dp: int, moe: bool, scale_grads: bool, engine: str = "ours"
) -> float:
    """One schedule on a (pp, dp) mesh against one process; returns the largest difference.

    Each replica's rows are split into micro-batches; the pipeline's loss is the sum of the
    micro-batches' losses (their mean with `scale_grads`), and the data-parallel reduction
    averages over replicas. One process computes that same sum over every replica's
    micro-batches, divided by the number of replicas.
    """
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    # float64 for the MoE: a top-k router's near-ties flip on float32 summation noise.
    dtype = torch.float64 if moe else torch.float32
    indices = _stage_indices(schedule, pp_rank, pp)
    num_stages = pp * STAGES_PER_RANK.get(schedule, 1)
    torch.manual_seed(0)
    blocks = [Block(moe).to(dtype) for _ in range(num_stages * BLOCKS_PER_STAGE)]
    reference = Stage(copy.deepcopy(blocks))
    stage_modules, stages = [], []
    for index in indices:
        module = Stage(blocks[index * BLOCKS_PER_STAGE : (index + 1) * BLOCKS_PER_STAGE])
        shard = fully_shard if engine == "ours" else torch_fully_shard
        options = {"mesh": mesh["dp"], "reshard_after_forward": schedule not in SPLIT_BACKWARD}
        for block in module.blocks:
            if block.experts is not None:
                shard(block.experts, **options)
            shard(block, **options)
        shard(module, mesh=mesh["dp"])
        assert isinstance(module, TorchFSDPModule)  # what the schedule looks for
        stage_modules.append(module)
        stages.append(
            PipelineStage(
                module, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    cls = SCHEDULES[schedule]
    kwargs: dict[str, Any] = {"loss_fn": _loss, "scale_grads": scale_grads}
    pipe = cls(stages if len(stages) > 1 else stages[0], NUM_MICROBATCHES, **kwargs)
    params = [p for m in stage_modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    # This rank's blocks in the reference, by their names in the stage modules.
    mine = {
        f"{k}.{name}": p
        for k, index in enumerate(indices)
        for name, p in Stage(
            list(reference.blocks[index * BLOCKS_PER_STAGE : (index + 1) * BLOCKS_PER_STAGE])
        ).named_parameters()
    }
    worst = 0.0
    reduces = _count_reduces() if engine == "ours" else None
    for step, (x, y) in enumerate(_batches(dp, dtype)):
        rows = slice(dp_rank * ROWS_PER_REPLICA, (dp_rank + 1) * ROWS_PER_REPLICA)
        args = (x[rows],) if 0 in indices else ()
        target = y[rows] if num_stages - 1 in indices else None
        if reduces is not None:
            reduces.clear()
        pipe.step(*args, target=target)
        if reduces is not None and step > 0:
            # The schedule turned gradient sync off for the micro-batches and reduced once:
            # one reduce-scatter per buffer per step, not one per micro-batch. (The first
            # step also runs a backward of its own to learn the gradients' shapes.)
            buffers = {id(b) for m in stage_modules for b in _buffers(m)}
            assert sorted(reduces) == sorted(buffers), (len(reduces), len(buffers))
        # The reference: the same micro-batch losses, summed, over every replica.
        total = torch.zeros((), dtype=dtype)
        for replica_x, replica_y in zip(x.chunk(dp), y.chunk(dp), strict=True):
            for mx, my in zip(
                replica_x.chunk(NUM_MICROBATCHES), replica_y.chunk(NUM_MICROBATCHES), strict=True
            ):
                total = total + _loss(reference(mx), my)
        (total / dp / (NUM_MICROBATCHES if scale_grads else 1)).backward()
        grads = {
            f"{k}.{name}": p.grad
            for k, m in enumerate(stage_modules)
            for name, p in m.named_parameters()
        }
        for name, ref in mine.items():
            grad = grads[name]
            if ref.grad is None:  # an expert no micro-batch of any replica chose
                assert grad is None, name
                continue
            assert grad is not None, name
            got = grad.full_tensor() if isinstance(grad, DTensor) else grad
            torch.testing.assert_close(got, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
            worst = max(worst, float((got - ref.grad).abs().max()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    if reduces is not None:
        _count_reduces(stop=True)
    for k, m in enumerate(stage_modules):
        for name, p in m.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            ref = mine[f"{k}.{name}"]
            torch.testing.assert_close(full.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
            worst = max(worst, float((full - ref).abs().max()))
    return worst


def _buffers(module: nn.Module) -> list[DBuffer]:
    """The DBuffers of every group under `module`."""
    return [
        buffer
        for state in states_under([module])
        if state.group is not None
        for buffer in state.group.buffers
    ]


_ORIGINAL_REDUCE = DBuffer.reduce_scatter


def _count_reduces(stop: bool = False) -> list[int]:
    """Records the id of the DBuffer of every reduce-scatter from now on (until `stop`)."""
    calls: list[int] = []
    if stop:
        DBuffer.reduce_scatter = _ORIGINAL_REDUCE  # type: ignore[method-assign]
        return calls

    def counted(self: DBuffer, *args: Any, **kwargs: Any) -> Any:
        calls.append(id(self))
        return _ORIGINAL_REDUCE(self, *args, **kwargs)

    DBuffer.reduce_scatter = counted  # type: ignore[method-assign]
    return calls


def check_manual_finalization() -> None:
    """`set_manual_backward_finalization` and `finalize_backward`, by their effect.

    Two micro-batches' backwards with gradient sync off leave no sharded gradient; one
    finalize reduces both at once and the gradients equal one process's on both micro-batches.
    An asynchronous finalize hands the gradients out at `wait()` (or at the next forward).
    """
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = [Block(moe=False) for _ in range(3)]
    reference = Stage(copy.deepcopy(blocks))
    model = Stage(blocks)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(dist.get_rank())
    micro = [torch.randn(2, DIM, generator=gen) for _ in range(2)]
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    for x in micro:
        model(x).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())  # nothing reduced or handed out
    model.set_requires_gradient_sync(True)
    model.finalize_backward()
    everything = [torch.zeros(2, 2, DIM) for _ in range(world)]
    dist.all_gather(everything, torch.stack(micro))
    for x in torch.cat(everything):
        reference(x).square().sum().backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad / world, msg=name)
    # Asynchronous: the reduces are in flight until wait().
    model.zero_grad()
    model(micro[0]).square().sum().backward()
    handle = model.finalize_backward(async_op=True)
    assert handle is not None and all(p.grad is None for p in model.parameters())
    expect_error(RuntimeError, model.finalize_backward, "was not waited on")
    handle.wait()
    assert all(p.grad is not None for p in model.parameters())
    # The mode cannot change while an iteration is open, nor be set on a non-root module.
    model(micro[0]).square().sum().backward()
    expect_error(
        RuntimeError, lambda: model.set_manual_backward_finalization(False), "cannot change"
    )
    expect_error(
        RuntimeError, lambda: model.blocks[0].set_manual_backward_finalization(True), "root"
    )
    model.finalize_backward()
    model.set_manual_backward_finalization(False)
    model.zero_grad()
    model(micro[0]).square().sum().backward()  # automatic again: handed out at once
    assert all(p.grad is not None for p in model.parameters())


def check_clip_across_stages(norm_type: float) -> None:
    """`clip_grad_norm_(..., pp_mesh=...)`: each rank one stage's parameters, as one process.

    Stage k holds parameters k, k + W, ...; the last rank holds none with a gradient (an
    empty stage). The total norm and the clipped gradients equal torch's over all of them.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    pp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    gen = torch.Generator().manual_seed(9)
    shapes = [(4, 3), (5,), (2, 2), (3,), (6, 1)]
    everything = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for param in everything:
        param.grad = torch.randn(param.shape, generator=gen)
    mine = [
        nn.Parameter(p.detach().clone())
        for i, p in enumerate(everything)
        if i % world == rank and (world == 1 or rank < world - 1)
    ]
    for param in mine:
        source = next(p for p in everything if p.shape == param.shape and torch.equal(p, param))
        param.grad = source.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(
        [p for i, p in enumerate(everything) if world == 1 or i % world < world - 1],
        0.5,
        norm_type=norm_type,
    )
    got = clip_grad_norm_(mine, 0.5, norm_type=norm_type, pp_mesh=pp_mesh)
    torch.testing.assert_close(got, expected)
    for param in mine:
        source = next(p for p in everything if torch.equal(p, param))
        torch.testing.assert_close(param.grad, source.grad)
