"""FSDP2's argument forms: Shard(d), ShardPlacementResult, dp_mesh_dims, int reshard."""

import api_forms_cases as cases
import pytest
import torch.distributed.fsdp as torch_fsdp

needs_spmd_api = pytest.mark.skipif(
    not hasattr(torch_fsdp, "DataParallelMeshDims"),
    reason="ShardPlacementResult and DataParallelMeshDims came with torch 2.13",
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_dim_cuts_inside_experts(pools, world) -> None:
    pools[world].run(cases.check_shard_dim_cuts_inside_experts)


@needs_spmd_api
def test_placement_result_puts_experts_on_their_own_mesh(pools) -> None:
    pools[4].run(cases.check_placement_result_puts_experts_on_their_own_mesh)


@needs_spmd_api
def test_dp_mesh_dims(pools) -> None:
    pools[4].run(cases.check_dp_mesh_dims)


@pytest.mark.parametrize(("world", "parts"), [(4, 2), (4, 4), (3, 3), (2, 1)])
def test_reshard_after_forward_int(pools, world, parts) -> None:
    pools[world].run(cases.check_reshard_after_forward_int, parts)


@needs_spmd_api
@pytest.mark.parametrize("world", [2, 4])
def test_spmd_types_parameters(pools, world) -> None:
    pytest.importorskip("spmd_types", reason="spmd_types comes with torchtitan (newest torch)")
    pools[world].run(cases.check_spmd_types_parameters)
