"""DBuffer gradients on 1-4 gloo ranks against single-process references."""

import dbuffer_grad_cases as cases
import pytest

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_scatter(pools, world) -> None:
    for op in ("sum", "avg"):
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_reduce_scatter, op, dtype)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gradient_accumulation_and_lazy_zeroing(pools, world) -> None:
    pools[world].run(cases.check_gradient_accumulation)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_async_handles_and_pending_work(pools, world) -> None:
    pools[world].run(cases.check_async_handles)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_training_by_hand_matches_single_process(pools, world) -> None:
    for optimizer in ("sgd", "adamw"):
        for mode in ("fp32", "bf16"):
            pools[world].run(cases.check_training_matches_single_process, optimizer, mode)
    if world == 4:
        pools[world].run(cases.check_training_matches_single_process, "adamw", "hsdp")


def test_hsdp_2x2(pools) -> None:
    pools[4].run(cases.check_hsdp)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_scatter_accumulate(pools, world) -> None:
    pools[world].run(cases.check_reduce_scatter_accumulate)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_release_grad(pools, world) -> None:
    pools[world].run(cases.check_release_grad)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_host_shard_trains_as_one_process(pools, world) -> None:
    # CPU offload: the shard and its gradient in host memory, gathered and reduced on the
    # compute device (here the same memory, but never the same tensors).
    for mode in ("fp32", "bf16"):
        pools[world].run(cases.check_training_matches_single_process, "adamw", mode, True)
    pools[world].run(cases.check_reduce_scatter_accumulate, True)
    pools[world].run(cases.check_release_grad, True)
    if world == 4:
        pools[world].run(cases.check_training_matches_single_process, "adamw", "hsdp", True)
        pools[world].run(cases.check_hsdp, True)
