"""fully_shard inside torch.distributed.pipelining schedules, against one process."""

import pipeline_cases as cases
import pytest
import torch

_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# torch 2.10's ScheduleZBVZeroBubble sends to its own rank (the V's turn), which gloo cannot
# do: FSDP2's run hangs there the same way (measured on 2.10.0; 2.13 and 2.15 run it).
_SCHEDULES = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            name == "zbv_zero_bubble" and _TORCH < (2, 11),
            reason="torch 2.10's ZBV schedule sends to its own rank, which gloo cannot",
        ),
    )
    for name in cases.SCHEDULES
]


@pytest.mark.parametrize("schedule", _SCHEDULES)
@pytest.mark.parametrize(("pp", "dp"), [(2, 1), (2, 2)], ids=["pp2xdp1", "pp2xdp2"])
def test_schedules_give_one_process_gradients(pools, schedule, pp, dp) -> None:
    worst = pools[pp * dp].run(cases.check_pipeline, schedule, pp, dp, False, False)
    print(f"{schedule} pp{pp} x dp{dp}: {max(worst):.2e}")


@pytest.mark.parametrize("scale_grads", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_zero_bubble"])
def test_moe_stages_with_and_without_scaled_gradients(pools, schedule, scale_grads) -> None:
    pools[4].run(cases.check_pipeline, schedule, 2, 2, True, scale_grads)


@pytest.mark.parametrize("world", [1, 3])
def test_manual_backward_finalization(pools, world) -> None:
    pools[world].run(cases.check_manual_finalization)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("world", [1, 3])
def test_clip_across_stages(pools, world, norm_type) -> None:
    pools[world].run(cases.check_clip_across_stages, norm_type)
