"""Tensor-parallel splits that are uneven (odd dims): fully_shard over torch.chunk's pieces.

A block is Linear(9, 27) colwise and Linear(27, 9) rowwise, so at tp 2 the pieces are 14 and
13 rows (colwise weight and bias) and 14 and 13 columns (rowwise weight); at tp 4, 7, 7, 7 and
6. Each such parameter is planned alone over dp with RaggedShard pieces of the first tp
rank's rows, cut off at a smaller piece's end.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_engine import fully_shard
from ragged_placement import RaggedShard

DIM, HIDDEN, ROWS_PER_REPLICA = 9, 27, 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _sharded(
    shape: tuple[int, int], engine: str = "ours", **options: Any
) -> tuple[_Net, DeviceMesh]:
    """The net on a (dp, tp) mesh: each block's pair tensor parallel, then fully_shard."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = _Net().double()
    shard: Any = fully_shard if engine == "ours" else torch_fully_shard
    for block in net.blocks:
        # Colwise's output gathered and Rowwise's input replicated: torch's TP itself cannot
        # hand an uneven Shard(-1) activation from one to the other (it infers even pieces).
        plan = {
            "0": ColwiseParallel(output_layouts=Replicate()),
            "2": RowwiseParallel(input_layouts=Replicate()),
        }
        parallelize_module(block, mesh["tp"], plan)
        shard(block, mesh=mesh["dp"], **options)
    shard(net, mesh=mesh["dp"], **options)
    return net, mesh


def _batches(num_replicas: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    rows = num_replicas * ROWS_PER_REPLICA
    return [torch.randn(rows, DIM, generator=gen, dtype=torch.float64) for _ in range(4)]


def _step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _adamw(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _mine(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    dp_rank = mesh.get_local_rank(0)
    return x[dp_rank * ROWS_PER_REPLICA : (dp_rank + 1) * ROWS_PER_REPLICA]


def check_uneven_tp_training(shape: tuple[int, int]) -> dict[str, Any]:
    """Ours on uneven tp pieces trains as one process on the whole batch (float64)."""
    net, mesh = _sharded(shape)
    torch.manual_seed(0)
    reference = _Net().double()
    num_tp = shape[1]
    uneven = [
        name
        for name, p in net.named_parameters()
        if isinstance(p, DTensor) and len(p.placements) == 2 and HIDDEN % num_tp
    ]
    for name, param in net.named_parameters():
        assert isinstance(param.placements[0], RaggedShard) or param.numel() == 0, name
    opt, ref_opt = _adamw(net), _adamw(reference)
    for x in _batches(shape[0]):
        _step(net, opt, _mine(x, mesh))
        _step(reference, ref_opt, x)
    for (name, got), want in zip(net.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want.detach(), msg=lambda m, n=name: n + m)
    return {"uneven": uneven}


def check_uneven_tp_save(directory: str, shape: tuple[int, int], engine: str) -> None:
    """Trains 2 steps, saves with DCP and records the full state on rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, mesh = _sharded(shape, engine)
    opt = _adamw(net)
    for x in _batches(shape[0])[:2]:
        _step(net, opt, _mine(x, mesh))
    model_state, optim_state = get_state_dict(net, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{directory}/dcp")
    full = _full_state(net, opt)
    if dist.get_rank() == 0:
        torch.save(full, f"{directory}/full.pt")
    dist.barrier()


def check_uneven_tp_load(directory: str, shape: tuple[int, int], engine: str) -> None:
    """Loads the checkpoint into a fresh net on `shape`: the full state bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net, _ = _sharded(shape, engine)
    opt = _adamw(net)
    x = torch.randn(ROWS_PER_REPLICA, DIM, dtype=torch.float64)
    _step(net, opt, x)  # state to load into (and different values than the saved ones)
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=f"{directory}/dcp")
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = _full_state(net, opt)
    if dist.get_rank() == 0:
        expected = torch.load(f"{directory}/full.pt", weights_only=False)
        assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


def _full_state(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments as full tensors, by name (every rank takes part)."""
    out = {}
    names = {id(p): n for n, p in net.named_parameters()}
    for name, param in net.named_parameters():
        out[name] = param.full_tensor().detach().clone()
    for param, state in copy.copy(opt.state).items():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            out[f"{names[id(param)]}.{key}"] = value.full_tensor().clone()
    return out


def check_state_dict_round_trip() -> None:
    """Uneven pieces, offloaded: torch.save / load and deepcopy of the state dicts keep every
    tensor, and loading them back (model and AdamW) steps as the original does."""
    import io

    from fsdp_engine import CPUOffloadPolicy

    net, mesh = _sharded((2, 2), offload_policy=CPUOffloadPolicy())
    opt = _adamw(net)
    batches = _batches(2)
    _step(net, opt, _mine(batches[0], mesh))
    saved = io.BytesIO()
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, saved)
    copied = copy.deepcopy(net.state_dict())
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    before = _full_state(net, opt)
    for name, value in net.state_dict().items():
        assert torch.equal(loaded["model"][name].full_tensor(), value.full_tensor()), name
        assert torch.equal(copied[name].full_tensor(), value.full_tensor()), name
    _step(net, opt, _mine(batches[1], mesh))  # move on, then load the saved state back
    net.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    after = _full_state(net, opt)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
