"""Behaviour FSDP2 defines around training (integer parameters, parameters assigned after
fully_shard, different models on different ranks, a re-created process group)."""

import engine_edges_cases as cases
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_engine import fully_shard


@pytest.mark.parametrize("world", [1, 2, 3])
def test_integer_frozen_parameter_trains_as_fsdp2(pools, world) -> None:
    for mixed in (False, True):
        pools[world].run(cases.check_integer_frozen_parameter, mixed)


@pytest.mark.parametrize("world", [1, 2])
def test_parameter_assigned_after_fully_shard(pools, world) -> None:
    pools[world].run(cases.check_parameter_assigned_before_first_forward)


def test_ranks_that_built_different_models_are_told_which_tensor(pools) -> None:
    messages = pools[3].run(cases.check_different_models_are_named)
    assert len(set(messages)) == 1, messages  # every rank raised the same error


def test_int_reshard_after_forward_after_the_process_group_is_created_again() -> None:
    # One process, torch's fake process group (collectives do nothing): the subgroups of an
    # int reshard_after_forward are made again under a new default group.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    for _ in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (4,))
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            for layer in model:
                fully_shard(layer, mesh=mesh, reshard_after_forward=2)
            fully_shard(model, mesh=mesh, reshard_after_forward=2)
            model(torch.randn(2, 8)).sum().backward()
            assert model[0].weight.grad is not None
        finally:
            dist.destroy_process_group()


def test_fully_shard_out_of_order_names_the_order(pools) -> None:
    pools[1].run(cases.check_out_of_order_calls)
