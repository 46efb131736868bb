"""Shared pytest fixtures for every package's tests."""

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
_OWNED = pytest.StashKey[str]()  # the cache folder this run made (and removes)


def pytest_configure(config: pytest.Config) -> None:
    """torch.compile's kernels go to a cache of this run's own, unless the caller chose one.

    Set before any test imports torch, so this process, the rank pools and every launched
    script inherit it. The default, /tmp/torchinductor_$USER, is shared by every run on the
    machine and its key misses ATEN_CPU_CAPABILITY: after a run with
    `ATEN_CPU_CAPABILITY=avx2` (how a CPU without AVX-512 is reproduced), the next run loaded
    kernels built for the other vector width, which wrote past their buffers (both ranks died
    in glibc's free()).
    """
    if _INDUCTOR_CACHE not in os.environ:
        os.environ[_INDUCTOR_CACHE] = tempfile.mkdtemp(prefix="ragged-fsdp-inductor-")
        config.stash[_OWNED] = os.environ[_INDUCTOR_CACHE]


def pytest_unconfigure(config: pytest.Config) -> None:
    """Removes the cache folder `pytest_configure` made."""
    owned = config.stash.get(_OWNED, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture(scope="session")
def pools() -> Iterator[object]:
    """Spawned gloo rank pools by world size, shared by the whole run (see tests/support).

    One set for the session, not one per module: each module's pools of 1-4 ranks cost 16-22 s
    of spawning and importing torch on 2 cores. A check leaves nothing behind in a rank that the
    next one could see (each builds its own meshes, models and seeds), and a rank that failed is
    replaced with its pool.
    """
    from rank_pool import Pools  # imported lazily: the planner's venv has no torch

    pools = Pools()
    yield pools
    pools.close()
