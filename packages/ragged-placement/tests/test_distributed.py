"""RaggedShard with torch's DTensor on 1-4 gloo ranks, against single-process references."""

import pytest
import ragged_cases as cases
from ragged_support import UNITS, WORLD_SIZES


def _shapes(units):
    n = sum(units)
    # (shape, dims): 1-D to 4-D; dims=(0, 1) keeps only the last dim whole.
    return [((4 * n,), (0,)), ((2 * n, 3), (0,)), ((n, 2, 5), (0, 1)), ((n, 2, 3, 2), (0,))]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_distribute_from_local_full_tensor(pools, world) -> None:
    for units in UNITS[world]:
        for shape, dims in _shapes(units):
            for dtype in ("fp32", "bf16"):
                for src in (None, 0):
                    pools[world].run(cases.check_roundtrip, shape, units, dims, dtype, src)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_with_local_reuses_the_spec_over_new_memory(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_with_local, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_full_tensor_receives_only_missing_elements(pools, world) -> None:
    units = UNITS[world][-1 if world > 1 else 0]
    results = pools[world].run(
        cases.check_roundtrip, (2 * sum(units), 3), units, (0,), "fp32", None
    )
    numel = 2 * sum(units) * 3
    owned = [u * 6 for u in units]
    assert [r["received"] for r in results] == [(numel - n) * 4 for n in owned]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_redistribute_paths_and_bytes(pools, world) -> None:
    unit_sets = UNITS[world]
    for old in unit_sets:
        for new in unit_sets:
            for dtype in ("fp32", "bf16"):
                shape = (2 * sum(old) * sum(new), 3)
                pools[world].run(cases.check_redistribute, shape, old, new, dtype)
    # A 3-D tensor: Shard(1) and Shard(2) on the other side.
    old, new = unit_sets[0], unit_sets[-1]
    pools[world].run(cases.check_redistribute, (sum(old) * sum(new), 2, 3), old, new, "fp32")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_comm_counter_sees_torch_collectives(pools, world) -> None:
    pools[world].run(cases.check_counter_sees_torch_collectives, 4 * world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_hot_gather_moves_data_only_to_the_owner(pools, world) -> None:
    owner = world - 1
    results = pools[world].run(cases.check_one_hot_gather, (world * 3, 4), owner)
    for rank, r in enumerate(results):
        if rank != owner:
            assert r["received"] == 0
    assert results[owner]["received"] == (world - 1) * 3 * 4 * 4


def test_hsdp_on_a_2x2_mesh(pools) -> None:
    for units in [(1, 1), (3, 1), (0, 2)]:
        pools[4].run(cases.check_hsdp, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_value_error(pools, world) -> None:
    pools[world].run(cases.check_bad_input)
