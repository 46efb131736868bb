"""ragged_optimizers on fully_shard(block_rows=32) models, 2-4 gloo ranks."""

import engine_optimizer_cases as cases
import pytest


@pytest.mark.parametrize("world", [2, 3, 4])
def test_optimizers_on_engine_parameters_match_one_process(pools, world) -> None:
    for optimizer in ("adamw8bit", "muon"):
        pools[world].run(cases.check_engine_training, optimizer)
