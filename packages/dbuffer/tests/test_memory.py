"""DBuffer memory on 1-4 gloo ranks: freed views, stream-ordered frees, no unplanned copies."""

import dbuffer_memory_cases as cases
import pytest

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world", [1, 3])
def test_freed_views_raise_and_come_back(pools, world) -> None:
    for how in ("argument", "environment"):
        pools[world].run(cases.check_freed_views_raise, how)


@pytest.mark.parametrize("world", [1, 3])
def test_freed_views_by_default(pools, world) -> None:
    pools[world].run(cases.check_freed_by_default)


@pytest.mark.parametrize("world", [1, 2])
def test_frees_wait_for_the_current_stream(pools, world) -> None:
    pools[world].run(cases.check_frees_wait_for_the_current_stream)


@pytest.mark.parametrize("world", [2, 3])
def test_unshard_and_reduce_scatter_make_no_copies(pools, world) -> None:
    # On gloo, unshard writes this rank's S elements into its own chunk of the global buffer
    # (one copy, or with mixed precision the one cast) and broadcasts each chunk in place:
    # gloo's all-gather would stage the whole output in a temporary and copy it over, so
    # nothing but the global buffer may be allocated, on any thread. The reduce all-reduces
    # the gradient buffer in place (gloo's reduce-scatter would clone all of it first) and
    # copies this rank's S elements out: one copy of S, no clone.
    for mixed in (False, True):
        results = pools[world].run(cases.check_zero_copy, mixed)
        for r in results:
            assert len(r["copies"]) == 1 and f"[[{r['shard_size']}]," in r["copies"][0], r
            assert r["unshard_allocated"] == r["buffer_bytes"], r
            assert r["reduce_copies"] == [[[r["shard_size"]], [r["shard_size"]], []]], r
            assert r["reduce_clones"] == 0, r
            assert r["allocating_ops"] == [], r
            # One allocation per unshard: the global buffer's storage growing back.
            assert r["storage_bytes"] == [0, r["buffer_bytes"]], r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_host_shard_crosses_once_each_way(pools, world) -> None:
    # CPU offload: an unshard copies the host shard into this rank's chunk of the gathered
    # buffer once (with mixed precision, the cast is that copy), even on one rank, where the
    # buffer otherwise aliases the shard; a reduce copies this rank's S reduced elements into
    # the host gradient shard once. Nothing else is copied or allocated by ours.
    for mixed in (False, True):
        for r in pools[world].run(cases.check_zero_copy, mixed, True):
            assert len(r["copies"]) == 1 and f"[[{r['shard_size']}]," in r["copies"][0], r
            assert r["unshard_allocated"] == r["buffer_bytes"], r
            assert r["reduce_copies"] == [[[r["shard_size"]], [r["shard_size"]], []]], r
            assert r["allocating_ops"] == [], r


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_backward_after_reshard_and_unshard(pools, world) -> None:
    for prefetch in (False, True):
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_backward_after_reshard_and_unshard, prefetch, dtype)
