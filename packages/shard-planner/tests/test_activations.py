"""Activation memory from shapes: what backward keeps, with and without checkpointing."""

from __future__ import annotations

import pytest

from shard_planner import (
    ActivationModel,
    ComputeModel,
    Estimate,
    GroupSpec,
    advise,
    estimate,
    load_preset,
)

H, F, V, E = 64, 176, 100, 4  # hidden, MLP width, vocabulary, experts


def _model(experts: int = 0) -> list[GroupSpec]:
    def block(i: int) -> GroupSpec:
        p = f"layers.{i}"
        shapes = {f"{p}.attn_norm.weight": (H,), f"{p}.attn.wqkv.weight": (3 * H, H),
                  f"{p}.attn.wo.weight": (H, H), f"{p}.mlp_norm.weight": (H,)}  # fmt: skip
        if experts:
            shapes[f"{p}.mlp.router.weight"] = (experts, H)
            for e in range(experts):
                for name, shape in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
                    shapes[f"{p}.mlp.experts.{e}.{name}.weight"] = shape
        else:
            for name, shape in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
                shapes[f"{p}.mlp.{name}.weight"] = shape
        return GroupSpec.from_shapes(p, shapes)

    return [
        GroupSpec.from_shapes("embed", {"embed.weight": (V, H)}),
        block(0),
        block(1),
        GroupSpec.from_shapes("final", {"norm.weight": (H,), "head.weight": (V, H)}),
    ]


# Per token: norms 2H, q/k/v in + out 4H, wo 2H, MLP 3 x (H + F); embedding H; final norm H
# and the head's input and logits H + V.
BLOCK = 2 * H + 4 * H + 2 * H + 3 * (H + F)
REST = H + H + (H + V)
LOSS = 12 * V  # bytes per token: the fp32 loss's log-softmax output and two gradients


def test_each_matmul_keeps_its_input_and_output_and_a_norm_its_input() -> None:
    acts = ActivationModel(seq_len=32, micro_batch=2)
    assert acts.bytes_for(_model(), compute_bytes=2) == 64 * ((2 * BLOCK + REST) * 2 + LOSS)
    fused_loss = ActivationModel(seq_len=32, micro_batch=2, loss_bytes_per_logit=0)
    assert fused_loss.bytes_for(_model(), compute_bytes=2) == 64 * (2 * BLOCK + REST) * 2
    # Routed experts: top_k of E per token, plus the router's input and logits.
    moe = ActivationModel(seq_len=32, micro_batch=2, top_k=2)
    routed = (H + E) + 2 / E * E * 3 * (H + F)
    block = BLOCK - 3 * (H + F)
    assert moe.bytes_for(_model(E), compute_bytes=2) == round(
        64 * ((2 * (block + routed) + REST) * 2 + LOSS)
    )
    with pytest.raises(ValueError, match="routes tokens to 4 experts: give top_k"):
        ActivationModel(seq_len=32).bytes_for(_model(E), compute_bytes=2)


def test_checkpointing_keeps_block_inputs_and_recomputes_one_block() -> None:
    acts = ActivationModel(seq_len=32, micro_batch=2, checkpointing=True)
    assert BLOCK * 2 > LOSS  # here the recomputed block is the larger of the two peaks
    assert acts.bytes_for(_model(), compute_bytes=2) == 64 * (REST + 2 * H + BLOCK) * 2
    scaled = ActivationModel(seq_len=32, micro_batch=2, checkpointing=True, scale=1.5)
    assert scaled.bytes_for(_model(), compute_bytes=2) == 64 * (1.5 * (REST + BLOCK) + 2 * H) * 2
    # The loss's peak comes before any block recomputes: the larger one counts, not both.
    big_loss = ActivationModel(seq_len=32, micro_batch=2, checkpointing=True,
                               loss_bytes_per_logit=100)  # fmt: skip
    assert 100 * V > BLOCK * 2
    assert big_loss.bytes_for(_model(), compute_bytes=2) == 64 * ((REST + 2 * H) * 2 + 100 * V)


def test_estimate_counts_activations_and_recompute() -> None:
    groups = load_preset("llama3-8b").groups
    plain = estimate(groups, shard_size=8, compute_bytes=2)
    acts = ActivationModel(seq_len=8192)
    full = estimate(groups, shard_size=8, compute_bytes=2, activations=acts)
    assert full.activation_bytes == acts.bytes_for(groups, compute_bytes=2)
    # Every activation is alive when backward begins (the loss's bytes on the last group):
    # the peak is there, beside the two groups gathered, before any gradient is reduced.
    assert full.peak.phase == f"backward of {groups[-1].name}", full.peak
    assert full.peak.activation_bytes == full.activation_bytes and full.peak.grad_bytes == 0
    assert full.peak.gathered_bytes == full.prefetch_unsharded_bytes
    assert plain.memory_bytes < full.memory_bytes <= plain.memory_bytes + full.activation_bytes
    ac = estimate(groups, shard_size=8, compute_bytes=2,
                  activations=ActivationModel(seq_len=8192, checkpointing=True))  # fmt: skip
    # Checkpointing keeps the blocks' inputs; the fp32 loss's 12 bytes per logit (here 12 GB
    # of the 17) stay.
    assert ac.checkpointing and ac.activation_bytes < full.activation_bytes / 3
    fused_loss = {"seq_len": 8192, "loss_bytes_per_logit": 0}
    no_loss = estimate(groups, shard_size=8, compute_bytes=2,
                       activations=ActivationModel(**fused_loss))  # fmt: skip
    fused_loss_ac = ActivationModel(**fused_loss, checkpointing=True)
    no_loss_ac = estimate(groups, shard_size=8, compute_bytes=2, activations=fused_loss_ac)
    assert no_loss_ac.activation_bytes < no_loss.activation_bytes / 5
    compute = ComputeModel(tokens_per_rank=8192)
    timed = estimate(groups, shard_size=8, compute=compute, activations=acts)
    recomputed = estimate(groups, shard_size=8, compute=compute, activations=ActivationModel(
        seq_len=8192, checkpointing=True))  # fmt: skip
    # 32 blocks run forward twice; the embedding and head do not.
    assert timed.compute_time_s < recomputed.compute_time_s < timed.compute_time_s * 4 / 3


def test_advise_checkpoints_only_when_the_activations_do_not_fit() -> None:
    groups = load_preset("llama3-8b").groups
    memory = 80 * 2**30
    short = advise(groups, num_ranks=64, ranks_per_node=8, memory_bytes=memory,
                   compute_bytes=2, activations=ActivationModel(seq_len=2048))  # fmt: skip
    assert not short[0].estimate.checkpointing  # fits without: recomputing only costs
    # 32K tokens: 184 GiB of activations without checkpointing, 22 GiB with.
    long = advise(groups, num_ranks=64, ranks_per_node=8, memory_bytes=memory,
                  compute_bytes=2, activations=ActivationModel(seq_len=32768))  # fmt: skip
    assert long and all(c.estimate.checkpointing for c in long)
    every = advise(groups, num_ranks=64, ranks_per_node=8, memory_bytes=memory, compute_bytes=2,
                   activations=ActivationModel(seq_len=32768), include_all=True)  # fmt: skip
    assert not any(c.fits for c in every if not c.estimate.checkpointing)


def test_advise_searches_resharding_optimizers_and_reduce_dtypes() -> None:
    groups = load_preset("llama3-8b").groups
    ranked = advise(groups, num_ranks=16, ranks_per_node=8, memory_bytes=80 * 2**30,
                    compute_bytes=2, block_rows=32, optimizers=["adamw", "adamw8bit"],
                    reduce_bytes=[4, 2], include_all=True)  # fmt: skip
    seen = {(c.optimizer, c.grad_bytes, c.estimate.reshard_after_forward) for c in ranked}
    assert seen == {(o, b, r) for o in ("adamw", "adamw8bit") for b in (4, 2)
                    for r in (True, False)}  # fmt: skip
    one = {(c.shard_size, c.optimizer, c.grad_bytes): c for c in ranked
           if c.estimate.reshard_after_forward and c.replicate_size == 1}  # fmt: skip
    assert (
        one[16, "adamw8bit", 4].estimate.optimizer_bytes
        < one[16, "adamw", 4].estimate.optimizer_bytes
    )
    assert one[16, "adamw", 2].estimate.reduce_scatter_bytes * 2 == (
        one[16, "adamw", 4].estimate.reduce_scatter_bytes
    )
    # Kept gathered after forward: one all-gather per group instead of two, every group held.
    kept = next(c for c in ranked if not c.estimate.reshard_after_forward)
    again = next(c for c in ranked if c.estimate.reshard_after_forward
                 and (c.shard_size, c.optimizer, c.grad_bytes)
                 == (kept.shard_size, kept.optimizer, kept.grad_bytes))  # fmt: skip
    assert kept.estimate.all_gather_bytes * 2 == again.estimate.all_gather_bytes
    assert kept.estimate.prefetch_unsharded_bytes > 10 * again.estimate.prefetch_unsharded_bytes
    with pytest.raises(ValueError, match="prefetch needs at least one depth"):
        advise(groups, num_ranks=16, ranks_per_node=8, memory_bytes=2**36, prefetch=[])
    # A model too large to keep gathered is not tried so (70B in bf16 is 140 GB).
    big = advise(load_preset("llama3-70b").groups, num_ranks=128, ranks_per_node=8,
                 memory_bytes=80 * 2**30, compute_bytes=2)  # fmt: skip
    assert all(c.estimate.reshard_after_forward for c in big)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be"),
        ({"seq_len": 8, "micro_batch": 0}, ValueError, "micro_batch must be"),
        ({"seq_len": 8, "checkpointing": 1}, TypeError, "checkpointing must be a bool"),
        ({"seq_len": 8, "scale": 0}, ValueError, "scale must be a positive number, got 0"),
    ],
)
def test_bad_activation_models(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        ActivationModel(**kwargs)


def test_command_line_prices_activations_and_searches_the_settings(capsys) -> None:
    from shard_planner._cli import main

    argv = ["advise", "--preset", "llama3-8b", "--ranks", "64", "--memory-gb", "80",
            "--compute-bytes", "2", "--seq-len", "32768", "--reduce-dtypes", "fp32,bf16",
            "--optimizers", "adamw,adamw8bit", "--block-rows", "32"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and "blocks, AC" in out and "16-bit reduce" in out
    assert "# activation checkpointing of every block first (checkpoint_wrapper)" in out
    # The first plan's peak by part, adding up to the table's figure.
    assert "memory of the first, per rank: parameters " in out and " activations " in out
    assert main(["estimate", "--preset", "llama3-8b", "--shard-size", "8", "--seq-len", "8192",
                 "--checkpointing", "--keep-gathered"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "activations (checkpointing every block)" in out
    assert "every group unsharded (kept gathered)" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["advise", "--preset", "llama3-8b", "--ranks", "8", "--memory-gb", "80",
              "--reduce-dtypes", "fp8"])  # fmt: skip
    assert exit_info.value.code == 2
    assert (
        "expected a comma-separated list of fp32, bf16, fp16, got 'fp8'" in capsys.readouterr().err
    )


def test_torchtitan_llama3_8b_at_32k_with_full_checkpointing() -> None:
    """torchtitan's published run (8 H100, FSDP 8, bf16, 32K tokens, full AC): 83.9 GiB.

    Without the fp32 loss the estimate was 40.4 GiB (0.48x); the loss's 12 bytes per logit
    over 32,768 x 128,256 logits are most of the rest.
    """
    groups = load_preset("llama3-8b").groups
    acts = ActivationModel(seq_len=32768, checkpointing=True)
    compute = ComputeModel(tokens_per_rank=32768, seq_len=32768)
    est = estimate(groups, shard_size=8, compute_bytes=2, activations=acts, compute=compute)
    assert 0.8 < est.memory_bytes / (83.9 * 2**30) < 1.2, est.memory_bytes / 2**30
    # Attention at 32K: 12 x 4096 x 32768 per token and block, 32 blocks, beside 6 N.
    attention = 12 * 4096 * 32768 * 32
    plain = estimate(groups, shard_size=8, compute=ComputeModel(tokens_per_rank=32768))
    assert est.flops_per_token == pytest.approx(plain.flops_per_token + attention)


def test_each_micro_batch_gathers_and_reduces_again() -> None:
    """FSDP's default under gradient accumulation: 8 micro-batches, 8x the collectives."""
    groups = load_preset("llama3-8b").groups
    compute = ComputeModel(tokens_per_rank=32768)
    one = estimate(groups, shard_size=8, compute_bytes=2, compute=compute,
                   activations=ActivationModel(seq_len=32768, checkpointing=True))  # fmt: skip
    eight = estimate(groups, shard_size=8, compute_bytes=2, compute=compute,
                     activations=ActivationModel(seq_len=4096, checkpointing=True))  # fmt: skip
    assert (one.micro_batches, eight.micro_batches) == (1, 8)
    assert eight.all_gather_bytes == 8 * one.all_gather_bytes
    assert eight.reduce_scatter_bytes == 8 * one.reduce_scatter_bytes
    assert eight.comm_time_s == pytest.approx(8 * one.comm_time_s)
    assert eight.compute_time_s == pytest.approx(one.compute_time_s)  # the same tokens
    assert eight.step_time_s > one.step_time_s  # 8 exposed first gathers and last reduces
    with pytest.raises(ValueError, match=r"tokens_per_rank 32,768 must be a whole number"):
        estimate(groups, shard_size=8, compute=compute,
                 activations=ActivationModel(seq_len=5000))  # fmt: skip


def test_selective_checkpointing_keeps_the_other_blocks_whole() -> None:
    """(1, 2): block 1 of the two is checkpointed, block 0 keeps its activations."""
    half = ActivationModel(seq_len=32, micro_batch=2, checkpointing=True,
                           checkpoint_ratio=(1, 2), loss_bytes_per_logit=0)  # fmt: skip
    # Kept: the rest, block 0 whole, block 1's input, and block 1 again while recomputed.
    assert half.bytes_for(_model(), compute_bytes=2) == 64 * (REST + BLOCK + H + BLOCK) * 2
    groups = load_preset("llama3-8b").groups
    compute = ComputeModel(tokens_per_rank=8192)

    def estimated(ratio: tuple[int, int]) -> Estimate:
        acts = ActivationModel(seq_len=8192, checkpointing=True, checkpoint_ratio=ratio)
        return estimate(groups, shard_size=8, compute=compute, compute_bytes=2, activations=acts)

    by_ratio = {ratio: estimated(ratio) for ratio in ((1, 1), (3, 4), (1, 2), (1, 4))}
    memory = [e.memory_bytes for e in by_ratio.values()]
    compute_s = [e.compute_time_s for e in by_ratio.values()]
    assert memory == sorted(memory) and compute_s == sorted(compute_s, reverse=True)
    # 8 of the 32 blocks recomputed at 1/4: a quarter of full checkpointing's extra compute.
    plain = estimate(groups, shard_size=8, compute=compute, compute_bytes=2)
    extra = [c - plain.compute_time_s for c in compute_s]
    assert extra[3] == pytest.approx(extra[0] / 4)
    for bad in ((0, 1), (3, 2), (1, 65), (1.0, 2)):
        with pytest.raises(ValueError, match="checkpoint_ratio must be"):
            ActivationModel(seq_len=8, checkpointing=True, checkpoint_ratio=bad)


def test_advise_fills_memory_with_fewer_checkpointed_blocks_when_compute_bound() -> None:
    groups = load_preset("llama3-8b").groups
    best = advise(groups, num_ranks=64, ranks_per_node=8, memory_bytes=80 * 2**30,
                  compute_bytes=2, compute=ComputeModel(tokens_per_rank=16384, seq_len=8192),
                  activations=ActivationModel(seq_len=8192))[0]  # fmt: skip
    # Without checkpointing nothing fits at 8 x 8; with every block it recomputes 32 blocks.
    assert best.estimate.checkpointing and best.estimate.checkpoint_ratio == (1, 4), best
