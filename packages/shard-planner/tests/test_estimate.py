"""estimate and advise: formulas against the plans, properties, scale, and bad input."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_planner import GroupSpec, TensorSpec, load_group_file, load_preset, plan_layout
from shard_planner._advise import advise, factorisations
from shard_planner._estimate import estimate


def _groups(tmp_path, groups):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"name": "m", "groups": groups}))
    return load_group_file(path).groups


shapes_st = st.lists(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 64)).map(list), min_size=1, max_size=4),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(
    shapes=shapes_st,
    world=st.integers(1, 12),
    replicas=st.integers(1, 3),
    block_rows=st.sampled_from([1, 4, 32]),
)
def test_estimate_adds_up_the_plans(tmp_path_factory, shapes, world, replicas, block_rows):
    tmp = tmp_path_factory.mktemp("m")
    raw = [
        {"name": f"g{i}", "tensors": [{"name": f"t{j}", "shape": s} for j, s in enumerate(group)]}
        for i, group in enumerate(shapes)
    ]
    groups = _groups(tmp, raw)
    est = estimate(groups, shard_size=world, replicate_size=replicas, block_rows=block_rows)
    layouts = [plan_layout(g.specs(block_rows), world, align=4) for g in groups]
    sizes = [layout.shard_size for layout in layouts]
    assert est.padding_elements == sum(layout.padding for layout in layouts)
    assert est.param_bytes == est.grad_bytes == 4 * sum(sizes)
    assert est.unsharded_bytes == 4 * world * max(sizes)
    assert est.all_gather_bytes == 2 * 4 * (world - 1) * sum(sizes)
    assert est.reduce_scatter_bytes == 4 * (world - 1) * sum(sizes)
    assert est.all_reduce_bytes == (4 * sum(sizes) if replicas > 1 else 0)
    real = sum(g.numel for g in groups)
    assert sum(est.optimizer_bytes_by_rank) == 8 * real  # AdamW: two fp32 moments, no padding
    assert est.optimizer_bytes == max(est.optimizer_bytes_by_rank)
    assert est.num_ranks == world * replicas


@pytest.mark.parametrize("num_ranks", [1, 12, 1024, 8192, 10240])
def test_every_factorisation_multiplies_to_the_rank_count(num_ranks) -> None:
    pairs = factorisations(num_ranks)
    assert all(r * w == num_ranks for r, w in pairs)
    assert len(pairs) == sum(1 for d in range(1, num_ranks + 1) if num_ranks % d == 0)


def test_advise_lists_only_fitting_splits_fastest_first() -> None:
    groups = load_preset("llama3-8b").groups
    memory = 40 * 2**30
    fitting = advise(groups, num_ranks=64, ranks_per_node=8, memory_bytes=memory)
    every = advise(groups, num_ranks=64, ranks_per_node=8, memory_bytes=memory, include_all=True)
    assert fitting and all(c.memory_bytes <= memory and c.fits for c in fitting)
    assert [c.estimate.comm_time_s for c in fitting] == sorted(
        c.estimate.comm_time_s for c in fitting
    )
    assert len(every) == len(factorisations(64)) > len(fitting)
    assert all(c.replicate_size * c.shard_size == 64 for c in every)
    assert every[: len(fitting)] == fitting


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-30b-a3b"])
def test_sharded_state_shrinks_as_the_shard_grows(preset) -> None:
    # A size feasible for W is feasible for 2W (the same placement), so per-rank shards and
    # state cannot grow with W; the unsharded groups and the traffic do not shrink.
    groups = load_preset(preset).groups
    previous = None
    for world in (8, 16, 32, 64, 128):
        est = estimate(groups, shard_size=world, optimizer="adamw")
        if previous is not None:
            assert est.param_bytes <= previous.param_bytes
            assert est.optimizer_bytes <= previous.optimizer_bytes
            assert est.unsharded_bytes >= previous.unsharded_bytes * 0.999
        previous = est


def test_optimizer_state_formulas() -> None:
    groups = load_preset("llama3-8b").groups
    adamw = estimate(groups, shard_size=1)
    assert adamw.optimizer_bytes == 8 * adamw.numel
    assert estimate(groups, shard_size=1, optimizer="sgd").optimizer_bytes == 4 * adamw.numel
    eight = estimate(groups, shard_size=1, optimizer="adamw8bit", block_rows=32)
    assert 2.0 < eight.optimizer_bytes / eight.numel < 2.02  # 1-D norms keep fp32 moments
    muon = estimate(groups, shard_size=1, optimizer="muon")
    # Matrices: Muon's momentum (4 bytes); embedding, head and 1-D norms: AdamW (8 bytes).
    embed = 128256 * 4096 * 2
    matrices = sum(e.numel for g in groups for e in g.entries if len(e.shape) >= 2)
    assert muon.optimizer_bytes == 4 * (matrices - embed) + 8 * (embed + muon.numel - matrices)


def test_gpt_oss_padding_with_16_row_blocks() -> None:
    groups = load_preset("gpt-oss-120b").groups
    ratios = {w: estimate(groups, shard_size=w, block_rows=16).padding_ratio for w in (256, 1024)}
    assert ratios[256] < 0.03 < ratios[1024]


def test_synthetic_trillion_scale_moe_at_10240_ranks_in_seconds() -> None:
    preset = load_preset("synthetic-moe-2.4t")
    assert 2.3e12 < preset.numel < 2.5e12
    start = time.perf_counter()
    est = estimate(preset.groups, shard_size=10240, compute_bytes=2)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, elapsed
    assert est.param_bytes >= 4 * math.ceil(preset.numel / 10240)


def test_bad_input() -> None:
    groups = load_preset("llama3-8b").groups
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        estimate(groups, shard_size=8, optimizer="lamb")
    with pytest.raises(ValueError, match="block_rows must be a multiple of 32, got 16"):
        estimate(groups, shard_size=8, optimizer="adamw8bit", block_rows=16)
    with pytest.raises(ValueError, match="shard_size"):
        estimate(groups, shard_size=0)
    with pytest.raises(ValueError, match="param_bytes must be 1, 2, 4 or 8"):
        estimate(groups, shard_size=8, param_bytes=3)
    with pytest.raises(ValueError, match="inter_node_gbps must be a finite number > 0"):
        estimate(groups, shard_size=8, inter_node_gbps=0)
    with pytest.raises(ValueError, match="groups is empty"):
        estimate([], shard_size=8)
    # What passed silently before: infinite or NaN links, tensors instead of groups, one group
    # instead of a list, a group without tensors, a memory size in GiB given as bytes.
    with pytest.raises(ValueError, match="inter_node_gbps must be a finite number > 0, got inf"):
        estimate(groups, shard_size=8, inter_node_gbps=float("inf"))
    with pytest.raises(ValueError, match="latency_us must be a finite number >= 0, got nan"):
        estimate(groups, shard_size=8, latency_us=float("nan"))
    with pytest.raises(TypeError, match=r"groups must be GroupSpecs .* got TensorSpec"):
        estimate([TensorSpec.from_shape("w", (4, 4))], shard_size=8)
    with pytest.raises(TypeError, match="got one GroupSpec: use \\[group\\]"):
        estimate(groups[0], shard_size=8)
    with pytest.raises(ValueError, match="group 'none' has no tensors"):
        estimate([GroupSpec("none", ())], shard_size=8)
    with pytest.raises(ValueError, match="80 is under 1 MiB; for 80 GiB pass 80 \\* 2\\*\\*30"):
        advise(groups, num_ranks=8, ranks_per_node=8, memory_bytes=80)
