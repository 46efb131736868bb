"""The step's peak, walked phase by phase (`_peak.step_peak`), and how `estimate` uses it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_planner import ActivationModel, Candidate, advise, estimate, load_preset
from shard_planner._peak import GroupBytes, Peak, step_peak

_SIZES = st.integers(0, 1000)
_GROUP = st.builds(GroupBytes, st.just("g"), _SIZES, _SIZES, _SIZES, _SIZES, _SIZES, _SIZES)


def _walked(groups: list[GroupBytes], prefetch: int, reshard: bool, accumulating: bool) -> int:
    """Each backward phase's live bytes summed directly (no prefix sums): the largest."""
    best = sum(g.sharded_grad for g in groups)
    for i, g in enumerate(groups):
        done = sum(h.sharded_grad for h in (groups if accumulating else groups[i + 1 :]))
        window = groups[max(0, i - prefetch) if reshard else 0 : i + 1]
        in_flight = groups[i + 1].reduce_input if i + 1 < len(groups) else 0
        live = (
            done
            + sum(h.kept for h in groups[:i])
            + max(g.kept + g.extra, g.unsharded_grads)
            + sum(h.gathered for h in window)
            + in_flight
        )
        best = max(best, live)
    return best


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_GROUP, min_size=1, max_size=8),
    st.integers(1, 3),
    st.booleans(),
    st.booleans(),
)
def test_peak_is_the_largest_phase(groups, prefetch, reshard, accumulating) -> None:
    peak = step_peak(groups, prefetch=prefetch, reshard_after_forward=reshard,
                     accumulating=accumulating)  # fmt: skip
    assert peak.total_bytes == _walked(groups, prefetch, reshard, accumulating)
    # Deeper prefetch, groups kept gathered, accumulation: each holds at least as much.
    deeper = step_peak(groups, prefetch=prefetch + 1, reshard_after_forward=reshard)
    assert (
        deeper.total_bytes
        >= step_peak(groups, prefetch=prefetch, reshard_after_forward=reshard).total_bytes
    )
    kept = step_peak(groups, prefetch=prefetch, reshard_after_forward=False)
    assert kept.total_bytes >= step_peak(groups, prefetch=prefetch).total_bytes
    # More activations on any group never lower the peak.
    bigger = [dataclasses.replace(groups[0], kept=groups[0].kept + 1), *groups[1:]]
    assert step_peak(bigger, prefetch=prefetch, reshard_after_forward=reshard,
                     accumulating=accumulating).total_bytes >= peak.total_bytes  # fmt: skip


def test_update_is_the_peak_when_the_gradients_outweigh_the_transients() -> None:
    groups = [GroupBytes(f"b{i}", 10, 10, 10, 1000) for i in range(3)]
    assert step_peak(groups, update_bytes=5) == Peak("optimizer update", 3000, update_bytes=5)
    assert step_peak([]) == Peak("optimizer update", 0)


def test_activations_peak_where_backward_begins_and_gradients_follow() -> None:
    groups = load_preset("llama3-8b").groups
    acts = ActivationModel(seq_len=8192)
    est = estimate(groups, shard_size=8, compute_bytes=2, activations=acts)
    # Before any reduce-scatter: no sharded gradient yet, every activation alive.
    assert est.peak.phase == f"backward of {groups[-1].name}" and est.peak.grad_bytes == 0
    assert est.memory_bytes == est.param_bytes + est.optimizer_bytes + est.peak.total_bytes
    # Without activations the gradients reduced so far, a group's unsharded gradients and the
    # reduce-scatter in flight decide it, late in backward.
    plain = estimate(groups, shard_size=8, compute_bytes=2)
    assert plain.peak.grad_bytes > plain.grad_bytes / 2 and plain.peak.activation_bytes == 0
    # Accumulating: every group's sharded gradient is there from the first micro-batch.
    compute_model = {"tokens_per_rank": 4 * 8192}
    from shard_planner._compute import ComputeModel

    accumulated = estimate(groups, shard_size=8, compute_bytes=2, activations=acts,
                           compute=ComputeModel(**compute_model))  # fmt: skip
    assert accumulated.micro_batches == 4
    assert accumulated.peak.grad_bytes == accumulated.grad_bytes
    assert accumulated.memory_bytes == est.memory_bytes + est.grad_bytes


@pytest.mark.parametrize("checkpointing", [False, True])
def test_advise_skips_only_splits_that_cannot_fit(checkpointing) -> None:
    # Its early skip (a lower bound of the peak) drops no split that fits.
    groups = load_preset("llama3-8b").groups
    acts = ActivationModel(seq_len=4096, checkpointing=checkpointing)
    for memory_gib in (20, 40, 80):
        memory = memory_gib * 2**30
        kwargs = {"num_ranks": 16, "ranks_per_node": 8, "memory_bytes": memory,
                  "activations": acts, "compute_bytes": 2}  # fmt: skip
        fitting = advise(groups, **kwargs)
        every = advise(groups, **kwargs, include_all=True)
        assert sorted(map(_key, fitting)) == sorted(_key(c) for c in every if c.fits), memory_gib


def _key(c: Candidate) -> tuple[object, ...]:
    est = c.estimate
    return (c.replicate_size, c.shard_size, est.checkpoint_ratio, est.reshard_after_forward,
            est.prefetch, est.dense_shard_size)  # fmt: skip


def test_activations_by_group_refuse_a_bad_element_size() -> None:
    groups = load_preset("llama3-8b").groups[:2]
    with pytest.raises(ValueError, match="compute_bytes"):
        ActivationModel(seq_len=8).by_group(groups, compute_bytes=0)
    kept, extra = ActivationModel(seq_len=8).by_group(groups, compute_bytes=2)
    assert len(kept) == len(extra) == 2 and kept[1] > 0
