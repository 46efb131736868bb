"""DBuffer on 1-4 gloo ranks against single-process references."""

import dbuffer_cases as cases
import pytest

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_unshard_views_and_reshard(pools, world) -> None:
    for dtype in ("fp32", "bf16"):
        for block_rows in (1, 4):
            pools[world].run(cases.check_unshard_and_views, dtype, block_rows)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_num_shard_dims_cuts_inside_leading_dims(pools, world) -> None:
    pools[world].run(cases.check_num_shard_dims)


@pytest.mark.parametrize(("world", "parts"), [(1, 1), (2, 2), (3, 3), (4, 2), (4, 1)])
def test_reshard_keeping_a_part_gathers_over_fewer_ranks(pools, world, parts) -> None:
    pools[world].run(cases.check_reshard_keeping_a_part, parts)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mixed_precision_and_async(pools, world) -> None:
    pools[world].run(cases.check_mixed_precision_unshard)
    pools[world].run(cases.check_async_unshard_overlaps_compute)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_scatter(pools, world) -> None:
    for op in ("sum", "avg"):
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_reduce_scatter, op, dtype)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gradient_accumulation_and_lazy_zeroing(pools, world) -> None:
    pools[world].run(cases.check_gradient_accumulation)


@pytest.mark.parametrize("world", [1, 3])
def test_freed_views_raise_and_come_back(pools, world) -> None:
    for how in ("argument", "environment"):
        pools[world].run(cases.check_freed_views_raise, how)


@pytest.mark.parametrize("world", [1, 3])
def test_freed_views_by_default(pools, world) -> None:
    pools[world].run(cases.check_freed_by_default)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_async_handles_and_pending_work(pools, world) -> None:
    pools[world].run(cases.check_async_handles)


@pytest.mark.parametrize("world", [1, 2])
def test_frees_wait_for_the_current_stream(pools, world) -> None:
    pools[world].run(cases.check_frees_wait_for_the_current_stream)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_training_by_hand_matches_single_process(pools, world) -> None:
    for optimizer in ("sgd", "adamw"):
        for mode in ("fp32", "bf16"):
            pools[world].run(cases.check_training_matches_single_process, optimizer, mode)
    if world == 4:
        pools[world].run(cases.check_training_matches_single_process, "adamw", "hsdp")


def test_hsdp_2x2(pools) -> None:
    pools[4].run(cases.check_hsdp)


@pytest.mark.parametrize("world", [1, 3])
def test_bad_input(pools, world) -> None:
    pools[world].run(cases.check_bad_input)


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


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_unshard_noop_accumulate_and_apply(pools, world) -> None:
    pools[world].run(cases.check_unshard_is_a_noop_while_unsharded)
    pools[world].run(cases.check_reduce_scatter_accumulate)
    pools[world].run(cases.check_apply_moves_storage)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_backward_after_reshard_and_unshard(pools, world) -> None:
    for prefetch in (False, True):
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_backward_after_reshard_and_unshard, prefetch, dtype)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_release_grad(pools, world) -> None:
    pools[world].run(cases.check_release_grad)


@pytest.mark.parametrize(("world", "shape"), [(2, (1, 2)), (4, (2, 2))])
def test_dtensor_entries_shard_their_local_pieces(pools, world, shape) -> None:
    pools[world].run(cases.check_dtensor_entries, shape)
    pools[world].run(cases.check_dtensor_entry_errors)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_comm_kinds_match_the_reference(pools, world) -> None:
    pools[world].run(cases.check_comm_kinds)
