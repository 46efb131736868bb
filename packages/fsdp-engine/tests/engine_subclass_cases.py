"""Tensor-subclass parameters (torchao NF4, QLoRA) against one process and against FSDP2.

The model: frozen NF4 base weights with trainable LoRA adapters and a LayerNorm per block,
`fully_shard` per block and on the root. Each rank trains on its own slice of every batch;
the one-process reference trains the same model on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from profiling import gathered_bytes
from rank_pool import expect_error
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchao.quantization import to_nf4
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4

from fsdp_engine import fully_shard

DIM = 128  # NF4 splits its scales' scales in 4 for (512, 128): W = 1, 2, 4
ROWS_PER_RANK = 2
STEPS = 3


class _LoRALinear(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, rank: int = 4, nf4: bool = True) -> None:
        super().__init__()
        base = to_nf4(torch.randn(dim_out, dim_in) / dim_in**0.5)
        # nf4=False: the same frozen weights, dequantized (a plain parameter in a DBuffer).
        self.weight = nn.Parameter(base if nf4 else base.get_original_weight(), requires_grad=False)
        self.lora_a = nn.Linear(dim_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # not zero: the step moves both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, NF4Tensor) or isinstance(
            getattr(self.weight, "_local_tensor", None), NF4Tensor
        ):
            base = linear_nf4(x, self.weight)
        else:
            base = nn.functional.linear(x, self.weight)
        return base + self.lora_b(self.lora_a(x))


class _Block(nn.Module):
    def __init__(self, dim: int, nf4: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = _LoRALinear(dim, 4 * dim, nf4=nf4)
        self.down = _LoRALinear(4 * dim, dim, nf4=nf4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _model(seed: int = 0, nf4: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(_Block(DIM, nf4), _Block(DIM, nf4))


def _batches(world: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(world * ROWS_PER_RANK, 8, DIM, generator=generator) for _ in range(STEPS)]


def _shard(model: nn.Sequential, engine: str, mesh: DeviceMesh, **options: Any) -> nn.Sequential:
    shard = fully_shard if engine == "ours" else torch_fully_shard
    for block in model:
        shard(block, mesh=mesh, **options)
    shard(model, mesh=mesh, **options)
    return model


def _train(model: nn.Module, batches: list[torch.Tensor], rows: slice) -> list[float]:
    """Losses of STEPS AdamW steps on each batch's `rows` (averaged over the data ranks)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in batches:
        loss = model(batch[rows]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized() and isinstance(model, TorchFSDPModule):
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter (NF4 dequantized), from any rank's DTensor or a tensor."""
    if isinstance(tensor, DTensor) and isinstance(tensor.to_local(), NF4Tensor):
        mesh = tensor.device_mesh
        local = tensor.to_local().get_original_weight()
        pieces = [torch.empty_like(local) for _ in range(mesh.size(mesh.ndim - 1))]
        dist.all_gather(pieces, local, group=mesh.get_group(mesh.ndim - 1))
        return torch.cat(pieces)
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if isinstance(tensor, NF4Tensor):
        return tensor.get_original_weight()
    return tensor.detach()


def _mesh(hsdp: bool) -> DeviceMesh:
    world = dist.get_world_size()
    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def check_nf4_qlora_training(hsdp: bool = False, reshard_after_forward: bool | int = True) -> None:
    """Ours trains QLoRA as one process and as FSDP2; the base weights stay NF4 shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _batches(world)
    reference = _train(_model(), batches, slice(None))
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    mesh = _mesh(hsdp)
    shard_size = mesh.size(mesh.ndim - 1)

    ours = _shard(_model(), "ours", mesh, reshard_after_forward=reshard_after_forward)
    weight = ours[0].up.weight
    assert isinstance(weight, DTensor) and isinstance(weight.to_local(), NF4Tensor)
    assert weight.placements[-1] == Shard(0) and not weight.requires_grad
    assert hsdp == (weight.placements[0] == Replicate())
    assert weight.to_local().shape == (4 * DIM // shard_size, DIM), weight.to_local().shape
    assert weight.shape == (4 * DIM, DIM)
    # The shard is the full tensor's NF4 rows, bit for bit.
    full_codes = _model()[0].up.weight.quantized_data
    local_rank = mesh.get_local_rank(mesh.ndim - 1)
    part = full_codes.numel() // shard_size
    assert torch.equal(
        weight.to_local().quantized_data, full_codes[local_rank * part : (local_rank + 1) * part]
    )
    losses = _train(ours, batches, rows)

    if world > 1:  # FSDP2 on one rank skips the subclass's hooks, which NF4 does not expect
        theirs = _shard(_model(), "fsdp2", mesh)
        fsdp2 = _train(theirs, batches, rows)
        torch.testing.assert_close(losses, fsdp2, rtol=1e-5, atol=0)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]  # it trains
    trained = _model()
    _train(trained, batches, slice(None))
    expected = dict(trained.named_parameters())
    for name, param in ours.named_parameters():
        # AdamW moves every weight by about lr per step whatever its gradient's size, so a
        # gradient near zero turns summation-order noise into ~1e-5 (measured 7.8e-6); a wrong
        # gradient moves weights by ~lr = 1e-2.
        torch.testing.assert_close(_full(param), _full(expected[name]), rtol=1e-4, atol=1e-4)
    # Between steps only the NF4 shards are held: no gathered parameter stays registered.
    assert ours[0].up.weight is weight


def check_nf4_checkpoint(directory: str) -> None:
    """DCP round trip of ours, and FSDP2's checkpoint loaded by ours (and back)."""
    import torch.distributed.checkpoint as dcp

    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _batches(world)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    mesh = _mesh(False)
    for saver in ("ours", "fsdp2"):
        model = _shard(_model(), saver, mesh)
        _train(model, batches[:1], rows)
        saved = {k: _full(v) for k, v in model.state_dict().items()}
        path = f"{directory}/{saver}"
        dcp.save(model.state_dict(), checkpoint_id=path)
        next_losses = _train(model, batches[1:], rows)
        for loader in ("ours", "fsdp2"):
            fresh = _shard(_model(seed=7), loader, mesh)  # other weights, NF4 ones too
            assert not torch.equal(_full(fresh[0].up.weight), saved["0.up.weight"])
            state = fresh.state_dict()
            dcp.load(state, checkpoint_id=path)
            fresh.load_state_dict(state)
            loaded = {k: _full(v) for k, v in fresh.state_dict().items()}
            assert loaded.keys() == saved.keys()
            for key, value in saved.items():
                assert torch.equal(loaded[key], value), (saver, loader, key)
            base = fresh[1].down.weight
            assert isinstance(base, DTensor) and isinstance(base.to_local(), NF4Tensor)
            # The loaded model goes on as the saved one did.
            torch.testing.assert_close(
                _train(fresh, batches[1:], rows), next_losses, rtol=1e-5, atol=0
            )
        # Meta init: the model made on the meta device, sharded, then given full weights by
        # load_state_dict(assign=True): the NF4 ones as full NF4Tensors (each rank keeps its
        # chunk), the others as full tensors. (torchao 0.18's NF4 `to_empty` leaves its
        # lookup table on the meta device, so `to_empty` + `dcp.load` is not a path for it.)
        with torch.device("meta"):
            on_meta = _shard(_model(seed=7), "ours", mesh)
        base = on_meta[0].up.weight
        assert base.device.type == "meta" and isinstance(base.to_local(), NF4Tensor)
        originals = dict(_model().named_parameters())  # the NF4 weights never train
        full = {
            k: originals[k].detach() if isinstance(originals[k], NF4Tensor) else v
            for k, v in saved.items()
        }
        on_meta.load_state_dict(full, assign=True)
        assert on_meta[0].up.weight is base and isinstance(base.to_local(), NF4Tensor)
        for key, value in on_meta.state_dict().items():
            assert value.device.type == "cpu", key
            assert torch.equal(_full(value), saved[key]), (saver, "meta", key)
        torch.testing.assert_close(
            _train(on_meta, batches[1:], rows), next_losses, rtol=1e-5, atol=0
        )


def check_nf4_gather_bytes() -> dict[str, Any]:
    """The bytes one rank receives in a step's gathers: NF4 base weights against bf16 ones.

    Both models gather in bf16 (`param_dtype`) what is not NF4: LoRA adapters and norms.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = _mesh(False)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    batch = _batches(world)[0][rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    counts = {}
    for key, nf4 in (("bf16", False), ("nf4", True)):
        model = _shard(_model(nf4=nf4), "ours", mesh, mp_policy=bf16)
        step = lambda m=model: m(batch).float().pow(2).mean().backward()  # noqa: E731
        step()  # lazy init (and its one check that the ranks built the same model) first
        counts[key] = gathered_bytes(step)
    # NF4 by its format: per 64 weights 32 bytes of codes and a 1-byte scale, per 256 scales
    # a 4-byte factor (128 bytes per 64 weights in bf16); the adapters and norms in bf16 from
    # their DBuffers (padding included). Each is gathered in forward and again in backward.
    nf4_weights = 4 * 512 * DIM
    nf4_bytes = nf4_weights // 64 * 33 + nf4_weights // (64 * 256) * 4
    buffers = [b for block in model for b in block._fsdp_engine_state.group.buffers]
    buffer_bytes = sum(2 * world * b.shard_size for b in buffers)
    assert counts["nf4"] == 2 * (nf4_bytes + buffer_bytes) * (world - 1) // world, counts
    return {**counts, "ratio": counts["nf4"] / counts["bf16"]}


def check_nf4_bad_input() -> None:
    """Trainable NF4 and rows that do not split over the ranks: clear errors."""
    world = dist.get_world_size()
    model = _model()
    model[0].up.weight.requires_grad_(True)
    expect_error(
        NotImplementedError,
        lambda: fully_shard(model[0]),
        "parameter 'up.weight' is a NF4Tensor with requires_grad=True",
    )
    if world == 3:
        expect_error(
            ValueError,
            lambda: fully_shard(_model()[0]),
            "parameter 'up.weight' is a NF4Tensor of shape (512, 128): its rows are gathered "
            "by its own hooks, which need them to split evenly over the 3 ranks",
        )
    if world != 3:
        # Conversions move the NF4 shards and keep them NF4; one that would dequantize is
        # refused before anything moves.
        sharded = fully_shard(_model()[1], mesh=init_device_mesh("cpu", (world,)))
        base = sharded.up.weight
        sharded.to("cpu")
        assert sharded.up.weight is base and isinstance(base.to_local(), NF4Tensor)
        expect_error(
            TypeError,
            lambda: sharded.to(torch.float64),
            "converting 'up.weight' would turn its NF4Tensor chunk into a Tensor",
        )
        assert isinstance(sharded.up.weight.to_local(), NF4Tensor)
        assert sharded.up.lora_a.weight.dtype == torch.float32
        # load_state_dict(assign=True) takes the full NF4Tensor or its DTensor, nothing else.
        expect_error(
            ValueError,
            lambda: sharded.load_state_dict(
                {"up.weight": torch.zeros(512, DIM)}, assign=True, strict=False
            ),
            "load_state_dict(assign=True) gives 'up.weight' a Parameter; it is sharded as a "
            "DTensor over a NF4Tensor of shape (512, 128)",
        )
    # A class with one hook of the two is refused, as FSDP2 does.
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(_HalfHooked), requires_grad=False)
    expect_error(TypeError, lambda: fully_shard(lin), "defines fsdp_pre_all_gather without")


class _HalfHooked(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh: DeviceMesh) -> Any:
        raise AssertionError("never called")
