"""Shared pytest fixtures for every package's tests."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def pools() -> Iterator[object]:
    """Spawned gloo rank pools by world size, shared by a test module (see tests/support)."""
    from rank_pool import Pools  # imported lazily: the planner's venv has no torch

    pools = Pools()
    yield pools
    pools.close()
