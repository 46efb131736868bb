"""Which (replicate, shard) split of N ranks to use: every factorisation that fits, ranked."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shard_planner._activations import ActivationModel
from shard_planner._compute import ComputeModel
from shard_planner._estimate import Estimate, estimate
from shard_planner._estimate_checks import BlockTooLargeError
from shard_planner._granularity import dense_blocks, has_experts, num_experts, split_experts
from shard_planner._presets import GroupSpec
from shard_planner._spec import check_count, check_world_size


@dataclass(frozen=True)
class Candidate:
    """One mesh shape and its estimate.

    Attributes:
        replicate_size: R, replicas (HSDP's outer axis; 1 is plain FSDP).
        shard_size: W, ranks per FSDP group.
        estimate: Memory and communication of this split.
        memory_bytes: Peak per rank, `estimate.memory_bytes` plus the activations given.
        fits: Whether `memory_bytes` is within the budget.
        headroom: The budget's fraction left free at the peak (negative: over budget).
        expert_groups: Groups each block's experts form (0: the blocks as given;
            `_granularity.split_experts`).
        optimizer: The optimizer whose state the estimate counts.
        grad_bytes: Bytes per gradient element, the reduction's dtype (4: fp32, 2: bf16).

    Activation checkpointing and reshard_after_forward are the estimate's
    (`estimate.checkpointing`, `estimate.reshard_after_forward`).
    """

    replicate_size: int
    shard_size: int
    estimate: Estimate
    memory_bytes: int
    fits: bool = True
    headroom: float = 0.0
    expert_groups: int = 0
    optimizer: str = "adamw"
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        if self.replicate_size * self.shard_size != self.estimate.num_ranks:
            raise ValueError(f"{self.replicate_size} x {self.shard_size} does not match")


def factorisations(num_ranks: int) -> list[tuple[int, int]]:
    """Every (replicate, shard) pair with replicate * shard == num_ranks, shard descending.

    Example:
        >>> factorisations(12)
        [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    """
    num_ranks = check_world_size("num_ranks", num_ranks)
    pairs = [(r, num_ranks // r) for r in range(1, num_ranks + 1) if num_ranks % r == 0]
    return pairs


def advise(
    groups: Sequence[GroupSpec],
    *,
    num_ranks: int,
    ranks_per_node: int,
    memory_bytes: int,
    activation_bytes: int = 0,
    min_shard_size: int = 1,
    min_headroom: float = 0.1,
    expert_groups: Sequence[int] | None = None,
    expert_parallel: Sequence[int] | None = None,
    activations: ActivationModel | None = None,
    reshard_after_forward: Sequence[bool] | None = None,
    optimizers: Sequence[str] | None = None,
    reduce_bytes: Sequence[int] | None = None,
    prefetch: Sequence[int] | None = None,
    dense_shard_sizes: Sequence[int] | None = None,
    include_all: bool = False,
    **options: Any,
) -> list[Candidate]:
    """Every (replicate, shard) factorisation of `num_ranks` whose memory fits, best first.

    Each split is estimated with `estimate(groups, shard_size=W, replicate_size=R, ...)`; it
    fits when its peak per rank (`Estimate.memory_bytes` + `activation_bytes`) is at most
    `memory_bytes`. Splits that leave at least `min_headroom` of the budget free come first,
    then the others; within each, candidates are ranked by predicted step time (with a
    `compute` model; else communication time), and
    times within 1% of the fastest remaining count as a tie, won by the most headroom (then
    the least padding). Shard sizes with fewer blocks than ranks in some group (ranks that
    would hold only padding) are skipped.

    Each split is tried with each group granularity of `expert_groups`: a block's experts
    in k groups of their own (`split_experts`), which shrinks the gathered transients of
    MoE blocks for k + 1 collectives per block instead of one.

    Args:
        groups: The model's FSDP groups.
        num_ranks: Ranks in all (R x W).
        ranks_per_node: Ranks per node (shard groups within a node use the fast links).
        memory_bytes: Memory per rank available for the model's state and transients.
        activation_bytes: Added to every candidate's peak (activations, workspace).
        min_shard_size: Skip splits with W below this (e.g. to keep some sharding).
        min_headroom: The fraction of `memory_bytes` a split should leave free to rank
            first (activations not counted, fragmentation), in [0, 1).
        expert_groups: The k to try (0: blocks whole). None: 0, 1, 2, 4 and 8 where the
            model's blocks have that many experts (fused experts: 0 and 1).
        expert_parallel: EP degrees to try, each with the experts as one group per block
            (k = 1; `estimate`'s expert_parallel). None: 1, and 2 .. 64 (powers of two that
            divide W and the experts) when a `compute` model with top_k and hidden_size
            prices the all-to-alls.
        activations: The batch a rank runs: each split is tried without and with activation
            checkpointing of every block (`estimate`'s activations).
        reshard_after_forward: The settings to try. None: True, and False where the whole
            model gathered (in the compute dtype) fits beside the sharded state.
        optimizers: Optimizers to try (None: `options`' optimizer, adamw by default).
        reduce_bytes: Gradient bytes per element to try, the reduction's dtype (None:
            `options`' grad_bytes, 4 by default; `[4, 2]` also tries bf16 reduction).
        prefetch: Prefetch depths to try (None: 1, and 2 with a `compute` model, where a
            deeper prefetch can hide a large group's gather behind several small ones).
        dense_shard_sizes: Sub-mesh sizes to try for a MoE model's dense blocks
            (`estimate`'s dense_shard_size), where the split pads 1% or more without, at
            prefetch 1. None: `ranks_per_node` (a node), when the model has dense blocks
            beside MoE blocks.
        include_all: Also return the splits that do not fit (`fits=False`), after the
            fitting ones, by memory.
        **options: Passed to `estimate` (param_bytes, grad_bytes, compute_bytes, optimizer,
            block_rows, align_bytes, intra_node_gbps, inter_node_gbps, latency_us,
            hop_latency_us, compute).

    Returns:
        The fitting candidates, best first (empty when none fits).

    Raises:
        ValueError: Bad arguments, or every shard size leaves ranks with only padding.

    Example:
        >>> from shard_planner import load_preset
        >>> best = advise(load_preset("llama3-8b").groups, num_ranks=64, ranks_per_node=8,
        ...               memory_bytes=80 * 2**30)[0]
        >>> best.replicate_size, best.shard_size
        (8, 8)
    """
    check_count("memory_bytes", memory_bytes, 1)
    if memory_bytes < 2**20:  # a count of GiB given as bytes would find nothing, silently
        raise ValueError(
            f"memory_bytes is in bytes: {memory_bytes} is under 1 MiB; for {memory_bytes} GiB "
            f"pass {memory_bytes} * 2**30"
        )
    check_count("activation_bytes", activation_bytes, 0)
    check_count("min_shard_size", min_shard_size, 1)
    given: object = min_headroom  # user input: check what came
    if not isinstance(given, int | float) or isinstance(given, bool) or not 0 <= given < 1:
        raise ValueError(f"min_headroom must be a fraction in [0, 1), got {min_headroom!r}")
    out, refused = [], []
    estimated = False  # some split was estimated (it may not fit): no refusal to raise
    granularities = _granularities(groups, expert_groups)
    degrees = _ep_degrees(groups, expert_parallel, options.get("compute"), num_ranks)
    checkpointing = _checkpointing(activations)
    dense = _dense_sizes(groups, dense_shard_sizes, ranks_per_node)
    choices = _choices(options, optimizers, reduce_bytes)
    numel = sum(g.numel for g in groups)
    gathered = options.get("compute_bytes") or options.get("param_bytes", 4)
    for (k, grouped, ep), acts, choice in itertools.product(
        _searched(groups, granularities, degrees), checkpointing, choices
    ):
        chosen = {**options, **choice}
        # Splits whose sharded state and activations alone exceed the memory are not
        # estimated (unless all are asked for): padding and transients only add to them.
        # Lower bounds of the peak: the update holds the sharded state; backward's start,
        # all but the gradients with every activation (and every group kept gathered).
        floor = numel * _bytes_per_element(chosen)
        floor_no_grads = floor - numel * chosen.get("param_bytes", 4)
        kept, extra = acts.by_group(grouped, compute_bytes=gathered) if acts else ([0], [0])
        act = sum(kept) + extra[-1]
        for (replicate, shard), reshard, depth in itertools.product(
            factorisations(num_ranks),
            _reshard_settings(reshard_after_forward),
            _depths(prefetch, options.get("compute")),
        ):
            if depth > 1 and not reshard:
                continue  # every group is gathered already
            if shard < min_shard_size or shard % ep:
                continue
            start = floor_no_grads / shard + act + (0 if reshard else numel * gathered)
            held = max(floor / shard, start) + activation_bytes
            if not include_all and held > memory_bytes:
                continue
            base_padding = 1.0
            # A dense sub-mesh is worth trying only where blocks pad (and once per split:
            # not again at each prefetch depth).
            for size in (None, *(dense if depth == 1 else ())):
                if size is not None and (shard % size or size >= shard or base_padding < 0.01):
                    continue
                try:
                    est = estimate(grouped, shard_size=shard, replicate_size=replicate,
                                   ranks_per_node=ranks_per_node, expert_parallel=ep,
                                   activations=acts, reshard_after_forward=reshard,
                                   prefetch=depth, dense_shard_size=size, **chosen)  # fmt: skip
                except BlockTooLargeError as err:
                    refused.append(err)
                    base_padding = 1.0  # too few blocks for W: fewer ranks may fit them
                    continue
                estimated = True
                if size is None:
                    base_padding = est.padding_ratio
                peak = est.memory_bytes + activation_bytes
                fits, headroom = peak <= memory_bytes, 1 - peak / memory_bytes
                if fits or include_all:
                    out.append(Candidate(replicate, shard, est, peak, fits, headroom, k,
                                         chosen.get("optimizer", "adamw"),
                                         chosen.get("grad_bytes", 4)))  # fmt: skip
    if refused and not out and not estimated:
        raise refused[0]  # no shard size of these ranks holds every group's blocks
    fitting = [c for c in out if c.fits]
    roomy = _rank([c for c in fitting if c.headroom >= min_headroom])
    tight = _rank([c for c in fitting if c.headroom < min_headroom])
    rest = sorted((c for c in out if not c.fits), key=lambda c: c.memory_bytes)
    return roomy + tight + rest


def _granularities(
    groups: Sequence[GroupSpec], expert_groups: Sequence[int] | None
) -> list[tuple[int, tuple[GroupSpec, ...]]]:
    """(k, the groups with each block's experts in k groups) for each k that applies."""
    if expert_groups is None:
        most = has_experts(groups)
        expert_groups = [k for k in (0, 1, 2, 4, 8) if k <= most]
    out = []
    for k in expert_groups:
        check_count("expert_groups entry", k, 0)
        grouped = split_experts(groups, k)
        if grouped is None:
            raise ValueError(
                f"the model's experts cannot form {k} groups per block (fused experts form "
                f"one; per-expert modules at most as many as a block has: {has_experts(groups)})"
            )
        out.append((k, grouped))
    return out


def _checkpointing(activations: ActivationModel | None) -> list[ActivationModel | None]:
    if activations is None:
        return [None]
    if not isinstance(activations, ActivationModel):
        raise TypeError(f"activations must be an ActivationModel, got {activations!r}")
    # No checkpointing; every block; 3 in 4, 1 in 2, 1 in 4 (the memory left between).
    variants: list[ActivationModel | None] = [dataclasses.replace(activations, checkpointing=False)]
    variants += [
        dataclasses.replace(activations, checkpointing=True, checkpoint_ratio=ratio)
        for ratio in CHECKPOINT_RATIOS
    ]
    return variants


CHECKPOINT_RATIOS = ((1, 1), (3, 4), (1, 2), (1, 4))  # checkpointed blocks: p of every q


def _dense_sizes(
    groups: Sequence[GroupSpec], given: Sequence[int] | None, ranks_per_node: int
) -> list[int]:
    if given is not None:
        return [check_count("dense_shard_sizes entry", d, 1) for d in given]
    return [ranks_per_node] if any(dense_blocks(groups)) else []


def _depths(given: Sequence[int] | None, compute: object) -> Sequence[int]:
    if given is None:
        return (1, 2) if compute is not None else (1,)
    if not given:
        raise ValueError("prefetch needs at least one depth to try")
    return [check_count("prefetch entry", d, 1) for d in given]


def _reshard_settings(given: Sequence[bool] | None) -> Sequence[bool]:
    if given is None:
        return (True, False)
    if not given or not all(isinstance(r, bool) for r in given):
        raise ValueError(f"reshard_after_forward must be a non-empty list of bools, got {given!r}")
    return given


def _choices(
    options: dict[str, Any], optimizers: Sequence[str] | None, reduce_bytes: Sequence[int] | None
) -> list[dict[str, Any]]:
    """The optimizer / gradient dtype settings to try, as `estimate` options."""
    names = [options.get("optimizer", "adamw")] if optimizers is None else list(optimizers)
    sizes = [options.get("grad_bytes", 4)] if reduce_bytes is None else list(reduce_bytes)
    if not names or not sizes:
        raise ValueError("optimizers and reduce_bytes need at least one entry each")
    return [{"optimizer": o, "grad_bytes": b} for o, b in itertools.product(names, sizes)]


def _bytes_per_element(options: dict[str, Any]) -> int:
    """The least state `estimate` counts per parameter: parameter, gradient, optimizer."""
    param = options.get("param_bytes", 4)  # the sharded gradients keep the parameters' dtype
    optimizer = {"adamw": 2 * param, "sgd": param, "muon": param, "adamw8bit": 2}
    return int(2 * param + optimizer.get(options.get("optimizer", "adamw"), 0))


def _ep_degrees(
    groups: Sequence[GroupSpec], given: Sequence[int] | None, compute: object, num_ranks: int
) -> list[int]:
    """The EP degrees to try (see `advise`)."""
    experts = num_experts(groups)
    if given is not None:
        degrees = [check_count("expert_parallel entry", e, 1) for e in given]
        if any(e > 1 for e in degrees) and not _prices_all_to_all(compute):
            raise ValueError(
                "expert parallelism sends tokens to their experts: pass compute="
                "ComputeModel(tokens_per_rank=..., top_k=..., hidden_size=...) to price it"
            )
        count = experts if experts else 1
        valid = [e for e in range(1, num_ranks + 1) if num_ranks % e == 0 and count % e == 0]
        bad = [e for e in degrees if e not in valid]
        if bad:
            what = f"the {experts} experts of each MoE block and " if experts else ""
            shown = ", ".join(map(str, valid[:12])) + (", ..." if len(valid) > 12 else "")
            raise ValueError(
                f"expert_parallel {bad[0]} must divide {what}the {num_ranks} ranks; valid: {shown}"
            )
        return degrees
    if experts < 2 or not _prices_all_to_all(compute):
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64) if e == 1 or experts % e == 0]


def _prices_all_to_all(compute: object) -> bool:
    return isinstance(compute, ComputeModel) and None not in (compute.top_k, compute.hidden_size)


def _searched(
    groups: Sequence[GroupSpec],
    granularities: list[tuple[int, tuple[GroupSpec, ...]]],
    degrees: list[int],
) -> list[tuple[int, tuple[GroupSpec, ...], int]]:
    """(k, groups, EP degree) to estimate: each k without EP; EP with experts apart (k = 1)."""
    out = [(k, grouped, 1) for k, grouped in granularities] if 1 in degrees else []
    with_ep = [e for e in degrees if e > 1]
    if with_ep:
        apart = split_experts(groups, 1)
        if apart is None:
            raise ValueError("expert parallelism needs the experts in groups of their own")
        out += [(1, apart, e) for e in with_ep]
    return out


TIE = 0.01  # predicted times this close (relative) are a tie: the model is not that precise


def _rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first; within `TIE` of the fastest left, no recompute, then headroom wins."""
    left = sorted(candidates, key=lambda c: c.estimate.time_s)
    ranked = []
    while left:
        limit = left[0].estimate.time_s * (1 + TIE)
        tied = [c for c in left if c.estimate.time_s <= limit]
        # Recomputing forward costs compute a time without a compute model does not show.
        best = max(
            tied,
            key=lambda c: (not c.estimate.checkpointing, c.headroom, -c.estimate.padding_elements),
        )
        ranked.append(best)
        left.remove(best)
    return ranked
