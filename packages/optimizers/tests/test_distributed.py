"""Both optimizers on 1-4 gloo ranks against one-process runs on the full tensors."""

import optimizer_cases as cases
import pytest

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_muon_matches_single_process_bitwise(pools, world) -> None:
    for kind in ("ragged", "shard0"):
        for bucket_bytes in (256, 32 * 2**20):  # a bucket per matrix, and one bucket
            pools[world].run(cases.check_muon_matches_single_process, kind, bucket_bytes)


def test_muon_posts_every_bucket_before_orthogonalizing(pools) -> None:
    owned = pools[3].run(cases.check_muon_posts_every_bucket_before_orthogonalizing)
    assert sum(owned) == cases.num_muon_units(3)  # every unit orthogonalized once


@pytest.mark.parametrize("world", [2, 3])
def test_muon_gradient_on_some_ranks_only_raises(pools, world) -> None:
    pools[world].run(cases.check_muon_grad_disagreement_raises)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_adamw8bit_matches_single_process_bitwise(pools, world) -> None:
    pools[world].run(cases.check_adamw8bit_matches_single_process)
    if world > 1:
        pools[world].run(cases.check_adamw8bit_rejects_cut_blocks)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "muon"])
def test_dcp_save_at_4_load_at_2_and_3_continues_bitwise(pools, tmp_path, optimizer) -> None:
    pools[4].run(cases.check_dcp_reshard, str(tmp_path), 4, optimizer)
    for world in (2, 3):
        pools[world].run(cases.check_dcp_reshard, str(tmp_path), 4, optimizer)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit"])
def test_beside_tensor_parallelism_matches_single_process_bitwise(pools, world, optimizer) -> None:
    # (dp, tp) = (1, 2) and (2, 2): RaggedShard over dp beside Shard(0), Shard(1), Replicate.
    pools[world].run(cases.check_tensor_parallel, optimizer)
