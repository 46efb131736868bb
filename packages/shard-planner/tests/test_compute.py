"""The compute term: FLOPs from shapes, the step time with FSDP's overlap, bad input."""

from __future__ import annotations

import pytest

from shard_planner import estimate, load_preset
from shard_planner._cli import main
from shard_planner._compute import ComputeModel, matmul_params, step_time
from shard_planner._granularity import split_experts


def test_flops_count_every_matrix_but_embeddings_and_top_k_experts() -> None:
    llama = load_preset("llama3-8b").groups
    per_group = matmul_params(llama, top_k=None)
    matrices = sum(
        e.numel for g in llama for e in g.entries
        if e.shape is not None and len(e.shape) >= 2 and "embed" not in e.name
    )  # fmt: skip
    assert sum(per_group) == matrices
    assert per_group[0] == 0  # the embedding group: a lookup
    deepseek = load_preset("deepseek-v3-671b-per-expert").groups
    layer = deepseek[5]  # an MoE block: attention, router, shared expert, 256 routed experts
    routed = sum(e.numel for e in layer.entries if ".experts." in e.name)
    dense = sum(
        e.numel for e in layer.entries
        if ".experts." not in e.name and e.shape is not None and len(e.shape) >= 2
    )  # fmt: skip
    assert matmul_params([layer], top_k=8) == [pytest.approx(dense + routed * 8 / 256)]
    # Experts split into groups count the same: each holds a share of the 256.
    split = split_experts(deepseek, 4)
    assert split is not None
    assert sum(matmul_params(split, 8)) == pytest.approx(sum(matmul_params(deepseek, 8)))
    with pytest.raises(ValueError, match="routes tokens to 256 experts: give top_k"):
        matmul_params(deepseek, None)


def test_step_time_overlaps_each_group_with_its_neighbours() -> None:
    # Compute-bound: every collective hides but the first gather and the last reduce.
    assert step_time([3.0, 3.0], [0.1, 0.1], [0.2, 0.2]) == pytest.approx(0.1 + 6.0 + 0.2)
    # Communication-bound: the collectives add up (2 gathers per group, then reduces).
    assert step_time([0.03, 0.03], [1.0, 1.0], [2.0, 2.0]) == pytest.approx(
        1.0 + max(0.01, 1.0) + 0.01 + max(0.02, 1.0) + max(0.02, 2.0) + 2.0
    )
    assert step_time([], [], []) == 0.0
    groups = load_preset("llama3-8b").groups
    model = ComputeModel(tokens_per_rank=4096)
    est = estimate(groups, shard_size=8, compute=model)
    assert est.flops_per_token == 6 * sum(matmul_params(groups, None))
    assert est.compute_time_s == pytest.approx(est.flops_per_token * 4096 / (989e12 * 0.4))
    update = est.optimizer_time_s
    # AdamW streams 2 x params + grads + 2 x state (fp32: 2 + 1 + 4 = 7 x 4 bytes/element).
    assert update == pytest.approx(7 * est.param_bytes / 3350e9)
    assert est.compute_time_s + update <= est.step_time_s
    assert est.step_time_s <= est.compute_time_s + update + est.comm_time_s
    assert est.exposed_comm_s == pytest.approx(est.step_time_s - est.compute_time_s - update)
    # No overlap (collectives and compute on the same cores): one after the other, all but
    # the last group's backward gather (it stays gathered from forward).
    serial = estimate(groups, shard_size=8, compute=ComputeModel(tokens_per_rank=4096, overlap=0))
    assert est.step_time_s < serial.step_time_s < est.compute_time_s + update + est.comm_time_s
    assert step_time([3.0, 3.0], [0.1, 0.1], [0.2, 0.2], overlap=0.5) == pytest.approx(
        0.1 + 6.0 + 0.2 + 0.5 * (0.1 + 0.1 + 0.2)  # half of what hid (2 gathers, 1 reduce)
    )
    more = estimate(groups, shard_size=8, compute=ComputeModel(tokens_per_rank=4 * 4096))
    assert more.exposed_comm_s < est.exposed_comm_s  # more compute hides more


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokens_per_rank": 0}, "tokens_per_rank must be an int >= 1"),
        ({"tokens_per_rank": 8, "top_k": 0}, "top_k must be an int >= 1 or None"),
        ({"tokens_per_rank": 8, "mfu": 1.5}, "mfu must be a finite number in"),
        ({"tokens_per_rank": 8, "peak_tflops": float("inf")}, "peak_tflops must be a finite"),
        ({"tokens_per_rank": 8, "overlap": 1.5}, r"overlap must be a number in \[0, 1\], got 1.5"),
        ({"tokens_per_rank": 8, "overlap": True}, "overlap must be a number"),
        ({"tokens_per_rank": 8, "memory_gbps": 0}, "memory_gbps must be a finite number"),
    ],
)
def test_bad_compute_models(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ComputeModel(**kwargs)


def test_advise_ranks_by_step_time_and_says_when_communication_dominates(capsys) -> None:
    # Without expert parallelism (--expert-parallel 1) the 2.4T model's FSDP traffic dwarfs
    # its compute.
    argv = ["advise", "--preset", "synthetic-moe-2.4t", "--ranks", "10240", "--memory-gb", "80",
            "--compute-bytes", "2", "--tokens-per-rank", "16384", "--top-k", "8",
            "--expert-parallel", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| step s | compute s | comm s/step |" in out
    assert "note: communication is" in out and "expert parallelism" in out


def test_a_deeper_prefetch_hides_a_large_gather_behind_several_groups() -> None:
    # Group 2's gather (3 s) is longer than group 1's compute: with one group ahead it shows;
    # two ahead, it starts during group 0 and hides behind groups 0 and 1.
    compute, gathers, reduces = [6.0] * 4, [0.1, 0.1, 3.0, 0.1], [0.1] * 4
    one = step_time(compute, gathers, reduces)
    two = step_time(compute, gathers, reduces, prefetch=2)
    assert two < one
    # Forward with one ahead: 0.1 + 2 + max(2, 3) + 2 + 2; two ahead: 0.1 + 8 (all hidden).
    assert one - two == pytest.approx(1.0)
    # Without overlap the depth changes nothing: everything runs one after the other.
    assert step_time(compute, gathers, reduces, overlap=0.0, prefetch=2) == pytest.approx(
        step_time(compute, gathers, reduces, overlap=0.0)
    )
    groups = load_preset("llama3-8b").groups
    deep = estimate(groups, shard_size=8, prefetch=2)
    base = estimate(groups, shard_size=8)
    # Three adjacent groups gathered at once instead of two (32 equal layers: 3/2 as much).
    assert deep.prefetch_unsharded_bytes > base.prefetch_unsharded_bytes
    assert deep.all_gather_bytes == base.all_gather_bytes
    with pytest.raises(ValueError, match="prefetch must be"):
        estimate(groups, shard_size=8, prefetch=0)


def test_attention_width_reads_query_projections_and_fused_qkv() -> None:
    from shard_planner import GroupSpec
    from shard_planner._compute import attention_width

    shapes = {
        "layers.0.self_attn.q_proj.weight": (4096, 4096),
        "layers.0.self_attn.k_proj.weight": (1024, 4096),
        "layers.0.mlp.up_proj.weight": (14336, 4096),
    }
    llama = GroupSpec.from_shapes("layers.0", shapes)
    fused = GroupSpec.from_shapes("layers.0", {"layers.0.attn.wqkv.weight": (3 * 512, 512)})
    mlp = GroupSpec.from_shapes("layers.0", {"layers.0.mlp.w1.weight": (1376, 512)})
    assert [attention_width(g) for g in (llama, fused, mlp)] == [4096, 512, 0]
    with pytest.raises(ValueError, match="seq_len must be an int >= 1 or None, got 0"):
        ComputeModel(tokens_per_rank=8, seq_len=0)
