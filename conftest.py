"""Shared pytest fixtures for every package's tests."""

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Spawned gloo rank pools by world size, shared by the whole run (see tests/support).

    One set for the session, not one per module: each module's pools of 1-4 ranks cost 16-22 s
    of spawning and importing torch on 2 cores. A check leaves nothing behind in a rank that the
    next one could see (each builds its own meshes, models and seeds), and a rank that failed is
    replaced with its pool.
    """
    from rank_pool import Pools  # imported lazily: the planner's venv has no torch

    # torch.compile's kernels go to a cache of this run's own (the ranks inherit it). The
    # default, /tmp/torchinductor_$USER, is shared by every run on the machine, and its key
    # misses ATEN_CPU_CAPABILITY: after a run with `ATEN_CPU_CAPABILITY=avx2` (how a CPU
    # without AVX-512 is reproduced), the next run loaded kernels built for the other vector
    # width, which wrote past their buffers (both ranks died in glibc's free()).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    pools = Pools()
    yield pools
    pools.close()
