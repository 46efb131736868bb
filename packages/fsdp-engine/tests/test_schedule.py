"""The schedule: output containers, per-iteration order, setters, half-done iterations."""

import engine_schedule_cases as cases
import pytest


@pytest.mark.parametrize("world", [1, 2, 3])
def test_outputs_keep_their_class_and_hooks(pools, world) -> None:
    for kind in ("dataclass", "dict", "registered"):
        pools[world].run(cases.check_output_containers, kind)


@pytest.mark.parametrize("world", [1, 2])
def test_schedule_follows_each_iteration(pools, world) -> None:
    pools[world].run(cases.check_schedule_follows_each_iteration)


@pytest.mark.parametrize("world", [1, 3])
def test_schedule_setters(pools, world) -> None:
    pools[world].run(cases.check_schedule_setters)


def test_requires_all_reduce_hsdp(pools) -> None:
    pools[4].run(cases.check_requires_all_reduce)


@pytest.mark.parametrize("world", [1, 3])
def test_half_done_iterations_are_refused_then_reset(pools, world) -> None:
    pools[world].run(cases.check_training_states_after_errors)
