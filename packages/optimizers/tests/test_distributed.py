"""Both optimizers on 1-4 gloo ranks against one-process runs on the full tensors."""

import math

import optimizer_cases as cases
import pytest

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_muon_matches_single_process_bitwise(pools, world) -> None:
    for kind in ("ragged", "shard0"):
        for bucket_bytes in (256, 32 * 2**20):  # a bucket per matrix, and one bucket
            pools[world].run(cases.check_muon_matches_single_process, kind, bucket_bytes)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_per_head_muon_matches_single_process_bitwise(pools, world) -> None:
    for kind in ("ragged", "shard0"):
        pools[world].run(cases.check_muon_per_head, kind)


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


def test_muon_dcp_saved_at_hsdp_2x2_loads_at_3_and_continues_bitwise(pools, tmp_path) -> None:
    pools[4].run(cases.check_dcp_reshard, str(tmp_path), 4, "muon", 2)
    pools[3].run(cases.check_dcp_reshard, str(tmp_path), 4, "muon", 2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit"])
def test_beside_tensor_parallelism_matches_single_process_bitwise(pools, world, optimizer) -> None:
    # (dp, tp) = (1, 2) and (2, 2): RaggedShard over dp beside Shard(0), Shard(1), Replicate.
    pools[world].run(cases.check_tensor_parallel, optimizer)


EQUAL_MATRICES = {f"block{i}": (64, 64) for i in range(8)}  # 8 Linear(64, 64) weights


@pytest.mark.parametrize("ns_batch_numel", [2**22, 1], ids=["batched", "one-per-batch"])
def test_hsdp_orthogonalizes_each_matrix_once_in_the_mesh(pools, ns_batch_numel) -> None:
    """(2, 2) HSDP: owners over the 4 ranks, not 2 per replica; bitwise one process."""
    from ragged_optimizers import ns_flops

    unique = len(EQUAL_MATRICES) * ns_flops((64, 64), 5)
    once = pools[4].run(cases.check_muon_hsdp, True, EQUAL_MATRICES, ns_batch_numel)
    twice = pools[4].run(cases.check_muon_hsdp, False, EQUAL_MATRICES, ns_batch_numel)
    busiest = max(r["flops"] for r in once) / unique
    assert busiest <= 0.30, busiest  # 2 of 8 matrices each (0.25)
    assert sum(r["flops"] for r in once) == unique  # once in the whole mesh
    # Per replica (the switch off): each replica orthogonalizes all 8 over its 2 ranks.
    assert max(r["flops"] for r in twice) / unique == 0.5
    assert sum(r["flops"] for r in twice) == 2 * unique
    for run in (once, twice):  # owner_plan() plans what runs
        assert [r["flops"] for r in run] == [r["planned"] for r in run], run
    # The price: over the replicate axis each rank sends the other replica its pieces of
    # its own replica's updates, in bfloat16: 4 of the 8 matrices (shard rank 0 of these
    # ragged rows holds fewer of them than rank 1).
    assert all(r["gathered_bytes"] == 4 * r["piece"] * 2 for r in once), once
    assert sum(r["gathered_bytes"] for r in once) == 2 * 4 * 64 * 64 * 2
    assert all(r["gathered_bytes"] == 0 for r in twice), twice


MIXED_MATRICES = {
    **{f"big{i}": (64, 64) for i in range(4)},  # 960 Newton-Schulz FLOPs per update byte
    **{f"small{i}": (16, 16) for i in range(4)},  # 240
}


def test_hsdp_prices_each_matrix_once_in_the_mesh_or_per_replica(pools) -> None:
    """With "auto", a matrix is shared when its FLOPs per update byte reach the price."""
    from ragged_optimizers import ns_flops

    big, small = ns_flops((64, 64), 5), ns_flops((16, 16), 5)
    priced = pools[4].run(cases.check_muon_hsdp, "auto", MIXED_MATRICES, 1, 500.0)
    copies = priced[0]["copies"]
    assert copies == {n: 1 if n.startswith("big") else 2 for n in MIXED_MATRICES}, copies
    assert sum(r["flops"] for r in priced) == 4 * big + 2 * 4 * small  # smalls in each replica
    assert [r["flops"] for r in priced] == [r["planned"] for r in priced]  # the plan, as run
    assert max(r["flops"] for r in priced) == big + 2 * small  # one big, half the smalls
    pieces = [r["piece"] for r in priced]  # shard rank 0 holds fewer ragged rows than 1
    # Over the replicate axis: each rank's pieces of the other replica's 2 big matrices only.
    assert [r["gathered_bytes"] for r in priced] == [2 * p * 2 for p in pieces], priced
    # The default price (2048: a GPU cluster's) keeps these small matrices in each replica.
    default = pools[4].run(cases.check_muon_hsdp, "auto", MIXED_MATRICES, 1)
    assert set(default[0]["copies"].values()) == {2}
    assert all(r["gathered_bytes"] == 0 for r in default)
    assert [r["flops"] for r in default] == [r["planned"] for r in default]


def test_hsdp_muon_matches_single_process_bitwise(pools) -> None:
    # Uneven, one-row, stacked and batched matrices (MUON_SHAPES) on the (2, 2) mesh.
    pools[4].run(cases.check_muon_hsdp, True, cases.MUON_SHAPES, 2**22)


def test_tp_group_with_a_replicated_matrix_first_keeps_tp_blocks_apart(pools) -> None:
    # A (dp, tp) group whose first matrix is Replicate over tp: not HSDP's replicas.
    pools[4].run(cases.check_tensor_parallel, "muon", True)


def test_tp_replicated_matrices_are_orthogonalized_once_over_dp_and_tp(pools) -> None:
    """A tp-Replicate matrix: tp is its replicate axis, so owners span dp x tp ranks."""
    from ragged_optimizers import ns_flops

    pools[4].run(cases.check_tensor_parallel, "muon", True, True)  # bitwise, shared path
    unique = len(cases.TP_REPLICATED) * ns_flops((32, 40), 5)
    once = pools[4].run(cases.check_muon_tp_replicated_flops, True)
    every = pools[4].run(cases.check_muon_tp_replicated_flops, False)
    assert sum(once) == unique and sum(every) == 2 * unique, (once, every)
    assert max(once) / unique == 0.25 and max(every) / unique == 0.5, (once, every)


def test_tensor_parallel_matrices_are_orthogonalized_on_one_tp_rank(pools) -> None:
    """(dp, tp) = (2, 2): each matrix once per dp owner, not once per tp rank."""
    once_runs = pools[4].run(cases.check_muon_tp_flops, True)
    every_runs = pools[4].run(cases.check_muon_tp_flops, False)
    once, every = [r["flops"] for r in once_runs], [r["flops"] for r in every_runs]
    assert sum(once) * 2 == sum(every)  # tp = 2 copies of the work before
    assert max(once) <= 0.55 * max(every), (once, every)
    print(f"busiest rank's Newton-Schulz FLOPs: {max(once) / max(every):.3f} of every tp rank's")
    # Over tp, per matrix: its dp owner's tp blocks gathered to one tp rank and scattered
    # back, in bfloat16: 2 x (tp - 1) blocks of numel / tp elements, 2 bytes each.
    numels = [math.prod(shape) for shape, _ in cases.TP_MANY.values()]
    assert sum(r["tp_bytes"] for r in once_runs) == sum(2 * (2 - 1) * n // 2 * 2 for n in numels)
