"""Checks run on each rank of a multi-GPU NCCL RankPool (see test_gpu.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer


def check_nccl_unshard_and_reduce_scatter() -> None:
    """Unshard (fp32, bf16, async) and reduce-scatter against the full tensors."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = {"w1": (17, 8), "b1": (8,), "w2": (3 * world + 1, 5), "empty": (0, 4)}
    tensors = [(n, torch.randn(s, generator=gen).cuda()) for n, s in shapes.items()]
    buf = DBuffer(tensors, mesh, block_rows=2)
    for dtype in (None, torch.bfloat16):
        handle = buf.unshard(dtype=dtype, async_op=True)
        torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
        handle.wait()
        for name, t in tensors:
            expected = t if dtype is None else t.to(dtype)
            assert torch.equal(buf.full(name, dtype=dtype), expected), (name, dtype)
        buf.reshard()
    for name in buf.names:
        buf.accumulate_grad(name, torch.full(shapes[name], float(rank + 1), device="cuda"))
    buf.reduce_scatter(op="avg", async_op=True).wait()
    mean = (world + 1) / 2
    for name, t in tensors:
        torch.testing.assert_close(buf.sharded_grad(name).full_tensor(), torch.full_like(t, mean))
