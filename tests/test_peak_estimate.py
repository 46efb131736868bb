"""The planner's peak memory per rank within 10% of the measured one, plans run as printed."""

import peak_cases as cases
import pytest

# (MoE, replicas, expert parallelism, bf16 gathers): dense FSDP, HSDP, HSDP x EP, bf16.
PLANS = {
    "fsdp": (False, 1, 1, False),
    "hsdp": (False, 2, 1, False),
    "hsdp-ep": (True, 2, 2, False),
    "bf16": (False, 1, 1, True),
}


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_estimated_peak_within_10_percent_of_measured(pools, world, plan) -> None:
    result = pools[world].run(cases.check_peak_within_10_percent, *PLANS[plan])[0]
    print(plan, world, result)
