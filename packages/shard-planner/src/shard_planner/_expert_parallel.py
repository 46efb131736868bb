"""Expert parallelism in the estimate: experts held whole by fewer ranks, tokens sent to them.

With EP degree e over a shard axis of W ranks (as torchtitan and fsdp_engine build it: the
`ep` axis inner, consecutive ranks, and `dp_shard / ep` outer), each rank holds E / e of a
block's E experts, FSDP-sharded over the W / e ranks that hold the same experts (strided by
e). Per rank, expert parameters stay E / W of the total, but an expert group gathers only its
E / e experts, over W / e ranks: e times fewer bytes per gather. In exchange each MoE block
sends its tokens to the experts' ranks and back: an all-to-all of `tokens x top_k x hidden`
activations (1 - 1/e of them leave the rank), twice forward and twice backward.

Experts must be in groups of their own (`split_experts` with k >= 1): under EP each rank's
k expert groups of a block hold E / (e k) experts each.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from shard_planner._compute import ComputeModel
from shard_planner._granularity import classify
from shard_planner._network import Net
from shard_planner._presets import GroupSpec

ALL_TO_ALLS_PER_BLOCK = 4  # dispatch and combine, forward and backward


def expert_groups_under_ep(
    groups: Sequence[GroupSpec], expert_parallel: int
) -> tuple[list[GroupSpec], list[bool]]:
    """The groups one rank holds under EP, and which of them are expert groups.

    An expert group keeps the first 1/e of its experts (they are alike); a fused one has its
    expert dim divided by e.

    Raises:
        ValueError: e > 1 and the experts are not in groups of their own, or e does not
            divide a group's experts.
    """
    out, is_expert = [], []
    for group in groups:
        rest, per_expert, fused, _ = classify(group)
        expert = not rest and bool(per_expert or fused)
        if expert_parallel > 1 and not expert and (per_expert or fused):
            raise ValueError(
                f"expert parallelism needs a block's experts in groups of their own, but "
                f"{group.name!r} holds experts with other tensors: use expert_groups >= 1"
            )
        if expert and expert_parallel > 1:
            group = _share(group, expert_parallel)
        out.append(group)
        is_expert.append(expert)
    return out, is_expert


@functools.lru_cache(maxsize=4096)  # advise asks for the same shares at every split
def _share(group: GroupSpec, ep: int) -> GroupSpec:
    _, per_expert, _, _ = classify(group)
    if per_expert:
        indices = sorted(per_expert)
        if len(indices) % ep:
            raise ValueError(
                f"expert parallelism of {ep} does not divide the {len(indices)} experts of "
                f"{group.name!r}"
            )
        # A rank numbers the experts it holds from 0 (as a ModuleList of its share does):
        # the chunk [lo:hi] of a block's experts is [lo/e : hi/e] on every rank.
        lo, hi = indices[0], indices[-1] + 1
        if lo % ep or hi % ep:
            raise ValueError(
                f"expert parallelism of {ep} does not divide the expert range {lo}:{hi} of "
                f"{group.name!r}"
            )
        kept = indices[: len(indices) // ep]
        name = re.sub(r"\[\d+:\d+\]$", f"[{lo // ep}:{hi // ep}]", group.name)
        entries = tuple(e for i in kept for e in per_expert[i])
        if lo:  # the first chunk keeps its numbers
            entries = tuple(
                e._replace(name=e.name.replace(f".experts.{i}.", f".experts.{lo // ep + i - lo}."))
                for i in kept
                for e in per_expert[i]
            )
        return GroupSpec(name, entries)
    shrunk = []
    for entry in group.entries:
        assert entry.shape is not None  # fused experts have shapes
        if entry.shape[0] % ep:
            raise ValueError(
                f"expert parallelism of {ep} does not divide the {entry.shape[0]} experts of "
                f"{entry.name!r}"
            )
        shape = (entry.shape[0] // ep, *entry.shape[1:])
        shrunk.append(entry._replace(shape=shape, numel=entry.numel // ep))
    return GroupSpec(group.name, tuple(shrunk))


def num_moe_blocks(groups: Sequence[GroupSpec]) -> int:
    """Blocks whose experts are in groups of their own (distinct experts modules)."""
    owners = set()
    for group in groups:
        rest, per_expert, fused, owner = classify(group)
        if not rest and (per_expert or fused):
            owners.add(owner)
    return len(owners)


def all_to_all(
    model: ComputeModel, num_blocks: int, ep: int, gathered: int, num_ranks: int, net: Net
) -> tuple[int, float]:
    """Bytes one rank sends and the time of a step's expert all-to-alls (module docstring)."""
    assert model.hidden_size is not None and model.top_k is not None  # checked by estimate
    per = model.tokens_per_rank * model.top_k * model.hidden_size * gathered * (ep - 1) // ep
    latency, gbps = net.ring(ep, 1, range(0, num_ranks, ep))
    count = ALL_TO_ALLS_PER_BLOCK * num_blocks
    return count * per, count * (latency + per / gbps)
