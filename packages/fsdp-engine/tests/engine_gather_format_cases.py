"""fp8 parameter gathers (`gather_format=BlockFloat8`) against one process and the bf16 gather.

The reference trains one process whose forward uses each matrix's blockwise
quantize-dequantize (a straight-through estimator: the gradient reaches the full-precision
weight as is), which is what the gathered fp8 weights are; the sharded runs must give its
losses and weights, and their gathered weights must be its quantize-dequantize bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from block_quantization import reference_block_qdq
from rank_pool import expect_error
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from dbuffer import BlockFloat8
from fsdp_engine import FSDPModule, fully_shard
from ragged_placement import CommCounter

BLOCK = (32, 64)
ROWS_PER_RANK = 2


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # 1-D parameters: gathered as usual
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 64, hidden: int = 160) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _shard(
    model: _Net, fmt: BlockFloat8 | None, mp: MixedPrecisionPolicy, *, hsdp: bool = False
) -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if hsdp:  # 2 replicas, each sharded over world / 2 ranks
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, gather_format=fmt, mp_policy=mp)
    fully_shard(model, mesh=mesh, gather_format=fmt, mp_policy=mp)


def _qdq_forward(model: _Net, tokens: torch.Tensor) -> torch.Tensor:
    """The reference loss: every matrix replaced by its quantize-dequantize, gradient as is."""
    weights = {
        name: p
        + (reference_block_qdq(p.detach(), BLOCK, torch.float8_e4m3fn, p.dtype) - p).detach()
        if p.dim() >= 2
        else p
        for name, p in model.named_parameters()
    }
    logits = torch.func.functional_call(model, weights, (tokens[:, :-1],))
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def check_float8_gather_training(steps: int = 3, hsdp: bool = False) -> None:
    """Each step of W ranks with fp8 gathers equals the one-process STE reference's.

    The reference takes the sharded model's master weights before every step: a master
    weight an fp32 rounding apart can round to another fp8 code (a 6% jump), so runs that
    drift apart by rounding would not stay comparable; per step, the same weights must give
    the same gathered weights (bit for bit), loss and gradients.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _Net()
    model = _Net()
    model.load_state_dict(reference.state_dict())
    fmt = BlockFloat8(BLOCK)
    _shard(model, fmt, MixedPrecisionPolicy(), hsdp=hsdp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 96, (world * ROWS_PER_RANK, 9), generator=gen)
        mine = tokens[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
        masters = {n: p.full_tensor() for n, p in model.named_parameters()}
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(masters[name])
        for group in groups:  # unshard() gathers one group, as FSDP2's
            group.unshard()
        for name, p in model.named_parameters():
            assert not isinstance(p, DTensor), name  # unsharded: the gathered tensor
            expected = masters[name]
            if p.dim() >= 2:
                expected = reference_block_qdq(expected, BLOCK, fmt.dtype, p.dtype)
            assert torch.equal(p.detach(), expected), name
        for group in groups:
            group.reshard()
        loss = _loss(model, mine)
        loss.backward()
        reference.zero_grad()
        expected_loss = _qdq_forward(reference, tokens)
        expected_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / world, expected_loss.detach(), rtol=1e-5, atol=1e-6)
        for (name, got), (_, want) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert got.grad is not None and want.grad is not None, name
            grad = got.grad.full_tensor()
            torch.testing.assert_close(grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        opt.zero_grad()


def _gathered_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes this rank receives in the gathers of one forward and backward."""
    with CommCounter() as counter:
        _loss(model, tokens).backward()
    return sum(
        c.bytes_received for c in counter.collectives if c.kind in ("all_gather", "broadcast")
    )


def check_float8_gather_bytes() -> dict[str, Any]:
    """fp8 gathers move at most 0.52x the bytes of bf16 gathers (scales and norms included)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tokens = torch.randint(0, 96, (ROWS_PER_RANK, 9), generator=torch.Generator().manual_seed(rank))
    counts = {}
    for key, fmt in (("bf16", None), ("fp8", BlockFloat8(BLOCK))):
        torch.manual_seed(0)
        # Sizes whose 32-row blocks split over 2 and 3 ranks without padding: in tensors this
        # small a whole block of padding would weigh (real models: `examples/train.py`).
        model = _Net(dim=96, hidden=288)
        _shard(model, fmt, bf16)
        counts[key] = _gathered_bytes(model, tokens)
    if world == 1:  # nothing crosses a wire
        assert counts == {"bf16": 0, "fp8": 0}, counts
        return counts
    ratio = counts["fp8"] / counts["bf16"]
    assert 0.4 < ratio <= 0.52, counts
    return {**counts, "ratio": ratio}


def check_gather_format_bad_input() -> None:
    """Formats that cannot be exact, or that are not formats, get an error naming the parameter."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expect_error(
        ValueError,
        lambda: fully_shard(_Net(), mesh=mesh, gather_format=BlockFloat8(BLOCK), block_rows=8),
        "could be cut by a shard boundary",
    )
    expect_error(
        ValueError,
        lambda: fully_shard(_Net(vocab=90), mesh=mesh, gather_format=BlockFloat8(BLOCK)),
        "'embed.weight' (shape (90, 64))",
    )
    expect_error(
        ValueError,
        lambda: fully_shard(_Net(), mesh=mesh, gather_format=lambda fqn, p: BlockFloat8(BLOCK)),
        "'blocks.0.norm.weight' has shape (64,)",
    )
    expect_error(
        TypeError,
        lambda: fully_shard(_Net(), mesh=mesh, gather_format=lambda fqn, p: "fp8"),
        "gather_format for 'embed.weight' must be a BlockFloat8 or None",
    )
    expect_error(TypeError, lambda: fully_shard(_Net(), mesh=mesh, gather_format="fp8"), "str")


def check_float8_gather_with_tensor_parallel() -> None:
    """fp8 gathers of tensor-parallel pieces (dp 2 x tp 2): each piece's blocks, exactly.

    Blocks of 2 x 24 tile every tensor-parallel piece of torch's test Transformer (rows split
    by ColwiseParallel, columns by RowwiseParallel), so the quantize-dequantize of each
    gathered piece equals that piece of the full tensor's; the loss equals one process's
    with every matrix quantize-dequantized.
    """
    import tp_cases

    block = (2, 24)
    fmt = BlockFloat8(block)
    _, dp_mesh, tp_mesh = tp_cases.make_mesh((2, 2))
    reference = tp_cases._model(torch.float32)
    model = tp_cases._model(torch.float32)
    tp_cases.Transformer.parallelize(model, tp_mesh, False, True)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, gather_format=fmt)
    fully_shard(model, mesh=dp_mesh, gather_format=fmt)
    masters = dict(reference.named_parameters())
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for group in groups:
        group.unshard()
    checked = 0
    for name, p in model.named_parameters():
        piece, local = masters[name].detach(), p.detach()
        if isinstance(p, DTensor):  # a tensor-parallel piece (norms are plain tensors)
            assert p.device_mesh == tp_mesh, name
            local = p.to_local()
            for placement in p.placements:
                if isinstance(placement, Shard):
                    size, index = tp_mesh.size(), tp_mesh.get_local_rank()
                    piece = piece.chunk(size, placement.dim)[index].contiguous()
            checked += isinstance(p.placements[0], Shard)
        if p.dim() >= 2:
            piece = reference_block_qdq(piece, block, fmt.dtype, p.dtype)
        assert torch.equal(local, piece), name
    # Pieces cut by tensor parallelism: 2 embeddings, per layer 4 attention and 2
    # feed-forward matrices and w1's bias, the output.
    assert checked == 2 + 7 * len(model.layers) + 1, checked
    for group in groups:
        group.reshard()
    tokens = torch.randint(0, 24, (4, 12), generator=torch.Generator().manual_seed(1))
    replica = dp_mesh.get_local_rank()
    loss = tp_cases._loss(model, tokens[replica * 2 : (replica + 1) * 2])
    total = loss.detach().clone()
    dist.all_reduce(total)  # each replica's loss, counted once per tensor-parallel rank
    weights = {
        n: reference_block_qdq(p.detach(), block, fmt.dtype, p.dtype) if p.dim() >= 2 else p
        for n, p in reference.named_parameters()
    }
    expected = torch.func.functional_call(reference, weights, (tokens,))
    expected_loss = nn.functional.cross_entropy(
        expected[:, :-1].reshape(-1, expected.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(total / 4, expected_loss.detach(), rtol=1e-5, atol=1e-6)
