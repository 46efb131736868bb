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


@pytest.mark.parametrize("world", [1, 3])
def test_bad_input(pools, world) -> None:
    pools[world].run(cases.check_bad_input)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_unshard_noop_and_apply(pools, world) -> None:
    pools[world].run(cases.check_unshard_is_a_noop_while_unsharded)
    pools[world].run(cases.check_apply_moves_storage)


@pytest.mark.parametrize(("world", "shape"), [(2, (1, 2)), (4, (2, 2))])
def test_dtensor_entries_shard_their_local_pieces(pools, world, shape) -> None:
    pools[world].run(cases.check_dtensor_entries, shape)
    pools[world].run(cases.check_dtensor_entry_errors)


@pytest.mark.parametrize(("world", "shape"), [(2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (4, (1, 4))])
def test_uneven_dtensor_entries(pools, world, shape) -> None:
    pools[world].run(cases.check_uneven_dtensor_entries, shape)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_comm_kinds_match_the_reference(pools, world) -> None:
    pools[world].run(cases.check_comm_kinds)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_block_rows_forms_plan_alike(pools, world) -> None:
    pools[world].run(cases.check_block_rows_forms)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_float8_gather_equals_one_process_blockwise_quantization(pools, world) -> None:
    for block_rows, cols, fmt in ((32, 64, "e4m3"), (128, 128, "e4m3"), (32, 128, "e5m2")):
        pools[world].run(cases.check_float8_gather_is_exact, block_rows, cols, fmt)
