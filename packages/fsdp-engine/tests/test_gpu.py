"""fully_shard on CUDA with NCCL: training equals single-process training; post-optim event.

Run by `nox -s gpu`; every test skips without CUDA. One rank per GPU (up to 2).
"""

from __future__ import annotations

import engine_cases as cases
import pytest
import torch
from rank_pool import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_nccl_training_matches_single_process() -> None:
    world = min(2, torch.cuda.device_count())
    pool = RankPool(world, backend="nccl")
    try:
        pool.run(cases.check_cuda_training)
    finally:
        pool.close()


def test_cpu_offload_on_cuda_keeps_state_in_pinned_host_memory() -> None:
    world = min(2, torch.cuda.device_count())
    pool = RankPool(world, backend="nccl")
    try:
        (result, *_) = pool.run(cases.check_cuda_offload)
        peaks = result["peak_bytes"]
        print(f"peak device memory, 3 steps: offloaded {peaks[True]} B, not {peaks[False]} B")
    finally:
        pool.close()
