"""DBuffer on 1-4 gloo ranks against single-process references."""

import dbuffer_cases as cases
import pytest
from rank_pool import Pools

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def pools():
    pools = Pools()
    yield pools
    pools.close()


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_unshard_views_and_reshard(pools, world) -> None:
    for dtype in ("fp32", "bf16"):
        for block_rows in (1, 4):
            pools[world].run(cases.check_unshard_and_views, dtype, block_rows)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mixed_precision_and_async(pools, world) -> None:
    pools[world].run(cases.check_mixed_precision_unshard)
    pools[world].run(cases.check_async_unshard_overlaps_compute)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_scatter(pools, world) -> None:
    for op in ("sum", "avg"):
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_reduce_scatter, op, dtype)


def test_hsdp_2x2(pools) -> None:
    pools[4].run(cases.check_hsdp)


@pytest.mark.parametrize("world", [1, 3])
def test_bad_input(pools, world) -> None:
    pools[world].run(cases.check_bad_input)
