"""RaggedShard with torch's DTensor on 1-4 gloo ranks, against single-process references."""

import pytest
import ragged_cases as cases

WORLD_SIZES = [1, 2, 3, 4]
# Balanced, uneven with an empty rank, and one-hot units for each world size.
UNITS = {
    1: [(1,), (3,)],
    2: [(1, 1), (3, 1), (0, 2)],
    3: [(1, 1, 1), (2, 0, 3), (0, 1, 0)],
    4: [(1, 1, 1, 1), (1, 0, 4, 2), (0, 0, 1, 0)],
}


def _shapes(units):
    n = sum(units)
    # (shape, dims): 1-D to 4-D; dims=(0, 1) keeps only the last dim whole.
    return [((4 * n,), (0,)), ((2 * n, 3), (0,)), ((n, 2, 5), (0, 1)), ((n, 2, 3, 2), (0,))]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_distribute_from_local_full_tensor(pools, world) -> None:
    for units in UNITS[world]:
        for shape, dims in _shapes(units):
            for dtype in ("fp32", "bf16"):
                for src in (None, 0):
                    pools[world].run(cases.check_roundtrip, shape, units, dims, dtype, src)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_with_local_reuses_the_spec_over_new_memory(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_with_local, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_full_tensor_receives_only_missing_elements(pools, world) -> None:
    units = UNITS[world][-1 if world > 1 else 0]
    results = pools[world].run(
        cases.check_roundtrip, (2 * sum(units), 3), units, (0,), "fp32", None
    )
    numel = 2 * sum(units) * 3
    owned = [u * 6 for u in units]
    assert [r["received"] for r in results] == [(numel - n) * 4 for n in owned]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_redistribute_paths_and_bytes(pools, world) -> None:
    unit_sets = UNITS[world]
    for old in unit_sets:
        for new in unit_sets:
            for dtype in ("fp32", "bf16"):
                shape = (2 * sum(old) * sum(new), 3)
                pools[world].run(cases.check_redistribute, shape, old, new, dtype)
    # A 3-D tensor: Shard(1) and Shard(2) on the other side.
    old, new = unit_sets[0], unit_sets[-1]
    pools[world].run(cases.check_redistribute, (sum(old) * sum(new), 2, 3), old, new, "fp32")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_comm_counter_sees_torch_collectives(pools, world) -> None:
    pools[world].run(cases.check_counter_sees_torch_collectives, 4 * world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_hot_gather_moves_data_only_to_the_owner(pools, world) -> None:
    owner = world - 1
    results = pools[world].run(cases.check_one_hot_gather, (world * 3, 4), owner)
    for rank, r in enumerate(results):
        if rank != owner:
            assert r["received"] == 0
    assert results[owner]["received"] == (world - 1) * 3 * 4 * 4


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_autograd(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_autograd, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_autograd_through_from_local_every_placement_pair(pools, world) -> None:
    for units in UNITS[world]:
        checked = pools[world].run(cases.check_from_local_autograd, (2 * sum(units), 3), units)
        assert checked == [11] * world, checked  # 3 sources x 4 targets, less Shard->Shard, + 1


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_and_foreach_ops(pools, world) -> None:
    for units in UNITS[world]:
        for dtype in ("fp32", "bf16"):
            pools[world].run(cases.check_elementwise, (2 * sum(units), 3), units, dtype)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_foreach_ops_run_on_the_locals(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_foreach_on_locals, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_foreach_ops_are_decided_entry_by_entry(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_foreach_decisions, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reductions(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_reductions, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reductions_along_dims(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_reductions_along_dims, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_views_factories_and_gathered_ops(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_views_factories_and_gathered_ops, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_clip_grad_norm_over_mixed_placements(pools, world) -> None:
    for units in UNITS[world]:
        if 12 % sum(units) == 0:
            pools[world].run(cases.check_clip_grad_norm, units)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizers_match_single_process(pools, world, name) -> None:
    units = UNITS[world]
    for impl in ("for-loop", "foreach", "fused"):
        pools[world].run(cases.check_optimizer, name, impl, units[0], units[-1])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_random_fills_equal_one_process(pools, world) -> None:
    for units in UNITS[world]:
        pools[world].run(cases.check_random_fills, "1d", units)
    if world == 4:
        pools[4].run(cases.check_random_fills, "tp", (1, 2))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_load_full_state_dict(pools, world) -> None:
    for units in UNITS[world]:
        for broadcast in (False, True):
            pools[world].run(cases.check_load_full_state_dict, broadcast, units)


def test_hsdp_on_a_2x2_mesh(pools) -> None:
    for units in [(1, 1), (3, 1), (0, 2)]:
        pools[4].run(cases.check_hsdp, (2 * sum(units), 3), units)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_value_error(pools, world) -> None:
    pools[world].run(cases.check_bad_input)


def test_checkpoint_save_on_4_load_on_2_3_4(pools, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    results = pools[4].run(cases.check_dcp_save, path, (1, 0, 4, 7))
    total = sum(r["data_bytes"] for r in results)
    for r in results:
        # Only plans and metadata cross ranks (tens of KB), never the tensor data (1.5 MB).
        assert r["collective_bytes"] < 0.05 * total, (r, total)
    pools[4].run(cases.check_dcp_load, path, "ragged", (3, 1, 1, 1))
    for world, units in ((2, (1, 2)), (3, (0, 1, 1))):
        for kind in ("ragged", "shard0", "replicate"):
            pools[world].run(cases.check_dcp_load, path, kind, units)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_composition_with_shard_on_the_other_axis(pools, layout, tmp_path) -> None:
    for i, units in enumerate([(1, 1), (3, 1), (0, 2)]):
        pools[4].run(cases.check_with_tensor_parallel, layout, units, str(tmp_path / f"ckpt{i}"))


def test_strided_ragged_shard(pools, tmp_path) -> None:
    for i, units in enumerate([(1, 1), (3, 1), (0, 2)]):
        pools[4].run(cases.check_strided, units, str(tmp_path / f"ckpt{i}"))
