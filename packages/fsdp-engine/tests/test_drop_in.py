"""What frameworks that drive FSDP2 rely on: torchft's hook, accelerate's assign, and more."""

import drop_in_cases as cases
import pytest


def test_all_reduce_hook_replaces_the_replicate_axis(pools) -> None:
    pools[4].run(cases.check_all_reduce_hook_replaces_replicate_axis)


@pytest.mark.parametrize("world", [1, 3])
def test_post_accumulate_grad_hooks_see_sharded_gradients(pools, world) -> None:
    pools[world].run(cases.check_post_accumulate_grad_hooks)


@pytest.mark.parametrize("world", [1, 3])
def test_load_state_dict_assign_adopts_the_values(pools, world) -> None:
    pools[world].run(cases.check_load_state_dict_assign)


@pytest.mark.parametrize("world", [1, 2])
def test_weight_tied_across_sibling_groups_is_refused(pools, world) -> None:
    pools[world].run(cases.check_tied_across_sibling_groups_is_refused)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_chunked_loss_list_group(pools, world) -> None:
    pools[world].run(cases.check_chunked_loss_list_group)


@pytest.mark.parametrize("world", [1, 3])
def test_loss_from_an_inner_output(pools, world) -> None:
    pools[world].run(cases.check_loss_from_an_inner_output)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_optimizers(pools, world) -> None:
    pools[world].run(cases.check_fused_optimizers)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_grad_scaler_skips_a_step_any_rank_overflowed(pools, world) -> None:
    pools[world].run(cases.check_grad_scaler)
