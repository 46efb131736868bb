"""FSDPModule's methods and the errors bad input gets, on 1-3 gloo ranks."""

import engine_module_cases as cases
import pytest


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_module_methods(pools, world) -> None:
    pools[world].run(cases.check_fsdp_module_methods)


@pytest.mark.parametrize("world", [1, 3])
def test_bad_input(pools, world) -> None:
    pools[world].run(cases.check_bad_input)
