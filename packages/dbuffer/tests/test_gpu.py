"""DBuffer on CUDA: stream-ordered frees (no record_stream), memory accounting, NCCL numerics.

Run by `nox -s gpu`; every test skips without CUDA. The single-GPU tests use a one-rank NCCL
group (collectives are skipped at one rank, the streams and the allocator are not); the NCCL
numerics need two GPUs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import gpu_cases
import pytest
import torch
import torch.distributed as dist
from rank_pool import RankPool
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dbuffer import DBuffer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough to lose any unordered race


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        yield init_device_mesh("cuda", (1,))
        dist.destroy_process_group()


@pytest.fixture
def no_record_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("DBuffer must not call record_stream")

    monkeypatch.setattr(torch.Tensor, "record_stream", refuse)


def test_reshard_frees_exactly_the_global_buffer(mesh: DeviceMesh, no_record_stream: None) -> None:
    # On one rank an unshard in the buffer's own dtype aliases the local shard (nothing to
    # allocate or free); a bf16 unshard has a buffer of its own, as on many ranks.
    tensors = [("w", torch.randn(1000, 256, device="cuda")), ("b", torch.randn(256, device="cuda"))]
    # Guarded views (check_freed): an unguarded one read while freed is an illegal access,
    # which would poison this process's CUDA context for every later test.
    buf = DBuffer(tensors, mesh, check_freed=True)
    before = torch.cuda.memory_allocated()
    buf.unshard().wait()
    assert torch.cuda.memory_allocated() == before  # aliased
    buf.unshard(dtype=torch.bfloat16).wait()
    view = buf.full("w", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    unsharded = torch.cuda.memory_allocated()
    buf.reshard()
    nbytes = buf.layout.buffer_numel * 2
    # The caching allocator rounds each block up to a multiple of 512 bytes.
    assert unsharded - torch.cuda.memory_allocated() == -(-nbytes // 512) * 512
    with pytest.raises(RuntimeError, match="unsharded tensor 'w' is freed"):
        view.sum()
    buf.unshard(dtype=torch.bfloat16).wait()
    assert torch.cuda.memory_allocated() == unsharded  # one allocation back, same size
    assert torch.equal(view, tensors[0][1].bfloat16())


def test_free_waits_for_the_reading_stream(mesh: DeviceMesh, no_record_stream: None) -> None:
    # Unshard on a side stream (its pool owns the buffer), read on the default stream
    # behind a long sleep, reshard, then let the side stream take the same block and
    # overwrite it. Only the explicit wait in reshard() keeps the read ahead of the write.
    # bf16: a buffer of its own even on one rank (see above).
    numel = 1 << 24
    buf = DBuffer([("w", torch.ones(numel, device="cuda"))], mesh)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        handle = buf.unshard(dtype=torch.bfloat16)
    handle.wait()  # the default stream waits for the side stream's unshard
    ptr = buf.full("w", dtype=torch.bfloat16).data_ptr()
    torch.cuda._sleep(SLEEP_CYCLES)
    out = buf.full("w", dtype=torch.bfloat16) * 2
    buf.reshard()
    with torch.cuda.stream(side):
        reuse = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        reuse.fill_(-1.0)
    torch.cuda.synchronize()
    assert reuse.data_ptr() == ptr, "the allocator did not reuse the block: race not armed"
    assert torch.equal(out, torch.full_like(out, 2.0))


def test_async_reduce_in_fp32_on_a_side_stream(mesh: DeviceMesh, no_record_stream: None) -> None:
    tensors = [("w", torch.randn(300, 64, device="cuda").bfloat16())]
    buf = DBuffer(tensors, mesh)
    buf.full_grad("w").fill_(0.5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = buf.reduce_scatter(op="sum", reduce_dtype=torch.float32, async_op=True)
    handle.wait()
    got = buf.sharded_grad("w").to_local().float()
    torch.cuda.synchronize()
    assert torch.equal(got, torch.full_like(got, 0.5))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL numerics need 2 GPUs")
def test_nccl_unshard_and_reduce_scatter_match_the_reference() -> None:
    pool = RankPool(min(torch.cuda.device_count(), 4), backend="nccl")
    try:
        pool.run(gpu_cases.check_nccl_unshard_and_reduce_scatter)
    finally:
        pool.close()
