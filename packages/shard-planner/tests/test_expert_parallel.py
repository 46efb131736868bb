"""Expert parallelism in the estimate and the search: bytes, all-to-alls, the 2.4T plan."""

from __future__ import annotations

import pytest

from shard_planner import GroupSpec, advise, estimate, load_preset
from shard_planner._cli import main
from shard_planner._compute import ComputeModel
from shard_planner._expert_parallel import expert_groups_under_ep, num_moe_blocks
from shard_planner._granularity import fully_shard_calls, split_experts

COMPUTE = ComputeModel(tokens_per_rank=16384, top_k=8, hidden_size=7168)


def _deepseek(k: int = 1):
    groups = split_experts(load_preset("deepseek-v3-671b-per-expert").groups, k)
    assert groups is not None
    return groups


def test_each_rank_holds_its_share_of_the_experts() -> None:
    groups = _deepseek()
    held, is_expert = expert_groups_under_ep(groups, 8)
    assert sum(is_expert) == num_moe_blocks(groups) == 58
    for group, mine, expert in zip(groups, held, is_expert, strict=True):
        assert mine.numel * (8 if expert else 1) == group.numel
    with pytest.raises(ValueError, match="experts in groups of their own"):
        expert_groups_under_ep(load_preset("deepseek-v3-671b-per-expert").groups, 8)
    with pytest.raises(ValueError, match="does not divide the 256 experts"):
        expert_groups_under_ep(groups, 3)


def test_a_rank_numbers_its_experts_from_0_and_shards_them_over_experts_mesh() -> None:
    layer = GroupSpec.from_shapes("l.0", {"l.0.attn.w": (8, 8)} | {
        f"l.0.mlp.experts.{e}.w": (4, 8) for e in range(8)})  # fmt: skip
    split = split_experts([layer], 2)
    assert split is not None
    held, is_expert = expert_groups_under_ep(split, 2)
    assert [g.name for g in held] == ["l.0", "l.0.mlp.experts[0:2]", "l.0.mlp.experts[2:4]"]
    assert is_expert == [False, True, True]
    assert [e.name for e in held[2].entries] == ["l.0.mlp.experts.2.w", "l.0.mlp.experts.3.w"]
    assert "\n".join(fully_shard_calls(held, experts_mesh="experts_mesh")).splitlines() == [
        "for lo in range(0, 4, 2):",
        "    fully_shard([model.l[0].mlp.experts[j] for j in range(lo, lo + 2)], "
        "mesh=experts_mesh)",
        "fully_shard(model.l[0])",
        "fully_shard(model)",
    ]
    odd = GroupSpec.from_shapes("l.0.mlp.experts[1:3]", {
        f"l.0.mlp.experts.{e}.w": (4, 8) for e in (1, 2)})  # fmt: skip
    with pytest.raises(ValueError, match="does not divide the expert range 1:3"):
        expert_groups_under_ep([odd], 2)


def test_ep_shrinks_gathers_and_pays_all_to_alls() -> None:
    groups = _deepseek()
    base = estimate(groups, shard_size=256, replicate_size=4, compute_bytes=2, compute=COMPUTE)
    ep = estimate(groups, shard_size=256, replicate_size=4, compute_bytes=2, compute=COMPUTE,
                  expert_parallel=8)  # fmt: skip
    # Per rank the experts' state is the same share (E / W); padding may move it a little.
    assert ep.param_bytes == pytest.approx(base.param_bytes, rel=0.01)
    # A MoE block's experts gather 1/8 of the bytes over 1/8 of the ranks.
    assert ep.all_gather_bytes < base.all_gather_bytes / 4
    assert ep.unsharded_bytes < base.unsharded_bytes
    # Four all-to-alls per MoE block of tokens x top-k x hidden x 2 bytes, 7/8 leaving.
    assert ep.all_to_all_bytes == 4 * 58 * (16384 * 8 * 7168 * 2 * 7 // 8)
    assert base.all_to_all_bytes == 0 and ep.expert_parallel == 8
    assert ep.compute_time_s == base.compute_time_s  # the same FLOPs, other tokens
    assert ep.comm_time_s < base.comm_time_s / 3
    with pytest.raises(ValueError, match="expert_parallel=8 sends tokens to their experts"):
        estimate(groups, shard_size=256, expert_parallel=8)
    with pytest.raises(ValueError, match="expert_parallel 3 must divide shard_size 256"):
        estimate(groups, shard_size=256, expert_parallel=3, compute=COMPUTE)


def test_the_2_4t_model_at_10240_ranks_gets_an_ep_plan_within_3x_of_compute(capsys) -> None:
    groups = load_preset("synthetic-moe-2.4t").groups
    ranked = advise(groups, num_ranks=10240, ranks_per_node=8, memory_bytes=80 * 2**30,
                    compute_bytes=2, compute=COMPUTE)  # fmt: skip
    best = ranked[0].estimate
    assert best.expert_parallel > 1 and best.comm_time_s <= 3 * best.compute_time_s
    without = advise(groups, num_ranks=10240, ranks_per_node=8, memory_bytes=80 * 2**30,
                     compute_bytes=2, compute=COMPUTE, expert_parallel=(1,))  # fmt: skip
    assert all(c.estimate.comm_time_s > 30 * c.estimate.compute_time_s for c in without)
    argv = ["advise", "--preset", "synthetic-moe-2.4t", "--ranks", "10240", "--memory-gb",
            "80", "--compute-bytes", "2", "--tokens-per-rank", "16384", "--top-k", "8"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| 1 | 10 x 1024 | experts apart, EP 64, prefetch 2 |" in out
    # The ranks holding the same experts: (replicate, dp) of a (10, 16, 64) mesh.
    assert 'init_device_mesh("cuda", (10, 16, 64), mesh_dim_names=("replicate", "dp", "ep"))' in out
    assert 'experts_mesh = ep_mesh["replicate", "dp"]' in out
    assert "for j in range(0, 16)], mesh=experts_mesh)" in out  # 256 / 64 experts, from 0
    assert "note: communication is" not in out  # within 3x: nothing to warn about


def test_ep_search_needs_the_all_to_alls_priced() -> None:
    groups = load_preset("deepseek-v3-671b-per-expert").groups
    with pytest.raises(ValueError, match="pass compute=ComputeModel"):
        advise(groups, num_ranks=1024, ranks_per_node=8, memory_bytes=80 * 2**30,
               expert_parallel=(1, 8))  # fmt: skip
    plain = advise(groups, num_ranks=1024, ranks_per_node=8, memory_bytes=80 * 2**30,
                   compute_bytes=2)  # fmt: skip
    assert {c.estimate.expert_parallel for c in plain} == {1}  # no compute: no EP tried
