"""Operations on RaggedShard DTensors on 1-4 gloo ranks, against the same ops on one process."""

import pytest
import ragged_ops_cases as cases
from ragged_support import UNITS, WORLD_SIZES


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_autograd(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_autograd, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_autograd_through_from_local_every_placement_pair(pools, world) -> None:
    for units in UNITS[world]:
        checked = pools[world].run(cases.check_from_local_autograd, (2 * sum(units), 3), units)
        assert checked == [11] * world, checked  # 3 sources x 4 targets, less Shard->Shard, + 1


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_and_foreach_ops(pools, world) -> None:
    for units in UNITS[world]:
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_elementwise, (2 * sum(units), 3), units, dtype)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_foreach_ops_run_on_the_locals(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_foreach_on_locals, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_foreach_ops_are_decided_entry_by_entry(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_foreach_decisions, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reductions(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_reductions, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reductions_along_dims(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_reductions_along_dims, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_views_factories_and_gathered_ops(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_views_factories_and_gathered_ops, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_clip_grad_norm_over_mixed_placements(pools, world) -> None:
    for units in UNITS[world]:
        if 12 % sum(units) == 0:
            pools[world].run(cases.check_clip_grad_norm, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizers_match_single_process(pools, world, name) -> None:
    units = UNITS[world]
    for impl in ("for-loop", "foreach", "fused"):
        pools[world].run(cases.check_optimizer, name, impl, units[0], units[-1])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_random_fills_equal_one_process(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_random_fills, "1d", units)
    if world == 4:
        pools[4].run(cases.check_random_fills, "tp", (1, 2))
