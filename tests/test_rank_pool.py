"""The test harness's rank pool: a rank that crashes fails the test at once, and says how."""

import time

import pytest
from pool_cases import abort_on_rank
from rank_pool import RankPool


def test_a_crashed_rank_fails_the_run_at_once_with_its_signal() -> None:
    pool = RankPool(2)
    try:
        assert pool.run(abort_on_rank, -1) == [0, 1]  # nobody aborts: the pool works
        start = time.monotonic()
        died = r"abort_on_rank: rank\(s\) died: rank 1 \(SIGABRT\)"
        with pytest.raises(RuntimeError, match=died):
            pool.run(abort_on_rank, 1, timeout=120)
        assert time.monotonic() - start < 60  # not the timeout: the dead rank was noticed
        assert pool.broken
    finally:
        pool.close()
