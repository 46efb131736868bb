"""shard_planner.estimate's bytes equal DBuffer's allocations and CommCounter's counts."""

import estimate_cases as cases
import pytest


@pytest.mark.parametrize(("world", "mode"), [(2, "fsdp"), (3, "fsdp"), (4, "fsdp"), (4, "hsdp")])
def test_estimate_equals_what_is_allocated_and_sent(pools, world, mode) -> None:
    for optimizer in ("adamw", "sgd", "muon", "adamw8bit"):
        pools[world].run(cases.check_estimate_matches, mode, optimizer)
    pools[world].run(cases.check_estimate_matches, mode, "adamw", True)  # a bf16 reduce
