"""Shared pytest fixtures for every package's tests."""

from collections.abc import Iterator

import pytest


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
