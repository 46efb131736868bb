"""FSDP2's argument forms: Shard(d), ShardPlacementResult, dp_mesh_dims, int reshard, mp casts."""

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


@pytest.mark.parametrize("world", [1, 3])
def test_mixed_precision_casts_as_fsdp2(pools, world) -> None:
    pools[world].run(cases.check_mixed_precision_casts)


@pytest.mark.parametrize("world", [1, 3])
def test_param_dtype_override_keeps_norms_in_fp32(pools, world) -> None:
    # fully_shard's own argument on every torch; torch 2.15's MixedPrecisionPolicy field
    # where it exists (compared with FSDP2 running it).
    sources = ["argument"]
    if "param_dtype_override_fn" in torch_fsdp.MixedPrecisionPolicy.__dataclass_fields__:
        sources.append("policy")
    for source in sources:
        result = pools[world].run(cases.check_param_dtype_override, source)[0]
        print(source, {k: [round(x, 5) for x in v] for k, v in result.items()})
    pools[1].run(cases.check_param_dtype_override_bad_input)
