"""Memory and communication of one FSDP / HSDP configuration, from shapes alone.

`estimate` plans every group at the shard size W (each distinct group once) and adds up what
one rank holds and sends in a training step. The formulas are in its docstring.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shard_planner._activations import RECOMPUTE, ActivationModel, is_checkpointed
from shard_planner._compute import ComputeModel, attention_width, matmul_params, step_time
from shard_planner._estimate_checks import (
    MIN_8BIT_NUMEL,
    QUANT_BLOCK,
    check_blocks_fit,
    check_element_bytes,
    check_expert_parallel,
    check_groups,
    check_links,
    check_models,
    check_optimizer,
)
from shard_planner._expert_parallel import all_to_all, expert_groups_under_ep, num_moe_blocks
from shard_planner._granularity import block_index, dense_blocks
from shard_planner._layout import Layout
from shard_planner._network import Net, Span, collective_times
from shard_planner._peak import GroupBytes, Peak, step_peak
from shard_planner._plan import plan_layout
from shard_planner._presets import GroupSpec
from shard_planner._spec import TensorSpec, check_count, check_world_size

_NOT_MUON = ("embed", "lm_head", "output", "head")  # names Muon leaves to its AdamW groups


@dataclass(frozen=True)
class Estimate:
    """Per-rank memory and per-step communication of one configuration (see `estimate`).

    Byte counts are per rank; `optimizer_bytes` is the most loaded rank's and
    `optimizer_bytes_by_rank` lists every shard rank's (replicas hold the same).
    `slowest_collectives_s`: one all-gather of the slowest group, and one reduce of the
    slowest (its reduce-scatter, and its all-reduce where it has copies).
    """

    shard_size: int
    replicate_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    optimizer_bytes_by_rank: tuple[int, ...]
    unsharded_bytes: int
    prefetch_unsharded_bytes: int
    reduce_scatter_input_bytes: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    padding_elements: int
    padding_bytes: int
    numel: int
    comm_time_s: float
    peak: Peak
    compute_time_s: float = 0.0
    step_time_s: float = 0.0
    flops_per_token: float = 0.0
    expert_parallel: int = 1
    all_to_all_bytes: int = 0
    optimizer_time_s: float = 0.0
    host_s: float = 0.0
    activation_bytes: int = 0
    checkpointing: bool = False
    reshard_after_forward: bool = True
    prefetch: int = 1
    dense_shard_size: int | None = None
    micro_batches: int = 1
    checkpoint_ratio: tuple[int, int] = (1, 1)
    slowest_collectives_s: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        for name in ("shard_size", "replicate_size"):
            check_count(name, getattr(self, name), 1)
        if len(self.optimizer_bytes_by_rank) != self.shard_size:
            raise ValueError("optimizer_bytes_by_rank needs one entry per shard rank")

    @property
    def time_s(self) -> float:
        """The step time when a compute model was given, else the communication time."""
        return self.step_time_s or self.comm_time_s

    @property
    def exposed_comm_s(self) -> float:
        """Communication the compute does not hide (step time minus compute, update, host)."""
        if not self.step_time_s:
            return self.comm_time_s
        return self.step_time_s - self.compute_time_s - self.optimizer_time_s - self.host_s

    @property
    def num_ranks(self) -> int:
        """replicate_size * shard_size."""
        return self.replicate_size * self.shard_size

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the model's elements."""
        return self.padding_elements / self.numel if self.numel else 0.0

    @property
    def memory_bytes(self) -> int:
        """Peak per rank: sharded parameters and optimizer state, and the step's peak.

        param + optimizer + `peak.total_bytes` (the largest live set of the step's phases,
        `_peak.py`: gradients reduced so far, activations, gathered groups, reduce-scatter
        inputs; or the update's).
        """
        return self.param_bytes + self.optimizer_bytes + self.peak.total_bytes


def _real_per_rank(layout: Layout) -> list[int]:
    """Elements of real tensors (not padding) on each rank."""
    size, out = layout.shard_size, [0] * layout.world_size
    for spec, start in zip(layout.tensors, layout.starts, strict=True):
        end = start + spec.numel
        for rank in range(start // size, (end - 1) // size + 1) if spec.numel else ():
            out[rank] += min(end, (rank + 1) * size) - max(start, rank * size)
    return out


def _optimizer_per_rank(layout: Layout, optimizer: str, param_bytes: int) -> list[int]:
    """Optimizer state bytes on each rank for one group's layout (kept: advise asks again)."""
    key = (id(layout), optimizer, param_bytes)
    known = _STATE.get(key)
    if known is None or known[0] is not layout:  # an id may be reused once a plan is gone
        known = _STATE[key] = (layout, _state_per_rank(layout, optimizer, param_bytes))
        if len(_STATE) > _MAX_PLANS:
            _STATE.popitem(last=False)
    return known[1]


def _state_per_rank(layout: Layout, optimizer: str, param_bytes: int) -> list[int]:
    if optimizer in ("adamw", "sgd"):
        per_element = 2 * param_bytes if optimizer == "adamw" else param_bytes
        return [n * per_element for n in _real_per_rank(layout)]
    size, out = layout.shard_size, [0] * layout.world_size
    for spec, start in zip(layout.tensors, layout.starts, strict=True):
        end = start + spec.numel
        shape = spec.shape or (spec.numel,)
        for rank in range(start // size, (end - 1) // size + 1) if spec.numel else ():
            piece = min(end, (rank + 1) * size) - max(start, rank * size)
            if optimizer == "muon":
                muon = len(shape) >= 2 and not any(k in spec.name for k in _NOT_MUON)
                out[rank] += piece * (param_bytes if muon else 2 * param_bytes)
            elif len(shape) == 2 and spec.numel >= MIN_8BIT_NUMEL:  # adamw8bit, 8-bit state
                lo, hi = layout.local_rows(spec.name, rank)
                grid = (-(-hi // QUANT_BLOCK) - lo // QUANT_BLOCK) * -(-shape[1] // QUANT_BLOCK)
                out[rank] += 2 * piece + 2 * 4 * grid  # two uint8 codes, two fp32 scales
            else:  # adamw8bit keeps fp32 moments for small and non-2-D tensors
                out[rank] += 2 * 4 * piece
    return out


def _layouts(
    groups: Sequence[GroupSpec],
    spans: Sequence[Span],
    shard_size: int,
    block_rows: int,
    align: int,
    optimizer: str,
    param_bytes: int,
    allow_idle_ranks: bool,
) -> tuple[list[int], list[int]]:
    """Each group's shard size S_g, and the optimizer state on each shard rank.

    Repeated layers (equal up to their indices) are planned once and counted; the answer is
    kept (advise asks again for every setting it tries at one split).
    """
    key = (
        tuple(g.layout_id for g in groups), tuple(spans), shard_size, block_rows, align,
        optimizer, param_bytes, allow_idle_ranks,
    )  # fmt: skip
    known = _LAYOUTS.get(key)
    if known is not None:
        return list(known[0]), list(known[1])
    uses: dict[tuple[int, Span], int] = {}
    for group, span in zip(groups, spans, strict=True):
        uses[group.layout_id, span] = uses.get((group.layout_id, span), 0) + 1
    planned: dict[tuple[int, Span], Layout] = {}
    by_span: dict[Span, list[int]] = {}  # per span, the state on each of its pieces
    for group, span in zip(groups, spans, strict=True):
        layout_key = (group.layout_id, span)
        if layout_key in planned:
            continue
        layout = planned[layout_key] = _plan(group, block_rows, span.width, align)
        if not allow_idle_ranks:
            check_blocks_fit(group, layout.tensors, span.width)
        per_rank = _optimizer_per_rank(layout, optimizer, param_bytes)
        total = by_span.setdefault(span, [0] * span.width)
        for i, state in enumerate(per_rank):
            total[i] += uses[layout_key] * state
    optimizer_by_rank = [0] * shard_size
    for span, total in by_span.items():
        # Rank i holds piece (i // stride) % width: each piece `stride` times in a row, the
        # pattern repeated over the shard group.
        per_rank = [t for t in total for _ in range(span.stride)] * (shard_size // span.block)
        optimizer_by_rank = [a + b for a, b in zip(optimizer_by_rank, per_rank, strict=True)]
    sizes = [planned[g.layout_id, span].shard_size for g, span in zip(groups, spans, strict=True)]
    _LAYOUTS[key] = (sizes, optimizer_by_rank)
    if len(_LAYOUTS) > _MAX_PLANS:
        _LAYOUTS.popitem(last=False)
    return list(sizes), list(optimizer_by_rank)


def _spans(
    groups: Sequence[GroupSpec],
    is_expert: Sequence[bool],
    shard_size: int,
    ep: int,
    dense_shard_size: int | None,
) -> list[Span]:
    """The ranks each group is sharded over (`_network.Span`)."""
    dense = [False] * len(groups)
    if dense_shard_size is not None:
        size = check_count("dense_shard_size", dense_shard_size, 1)
        if shard_size % size:
            raise ValueError(f"dense_shard_size {size} must divide shard_size {shard_size}")
        dense = dense_blocks(groups)
        if not any(dense):
            raise ValueError(
                "dense_shard_size shards a MoE model's dense blocks apart, and this model has "
                "none (blocks with experts beside blocks without): use replicate_size"
            )
    out = []
    for expert, apart in zip(is_expert, dense, strict=True):
        if expert and ep > 1:  # the W / e ranks holding the same experts, e apart
            out.append(Span(shard_size // ep, ep))
        elif apart and dense_shard_size is not None:
            out.append(Span(dense_shard_size))
        else:
            out.append(Span(shard_size))
    return out


def _all_to_all(
    compute: ComputeModel | None,
    groups: Sequence[GroupSpec],
    ep: int,
    gathered: int,
    num_ranks: int,
    net: Net,
) -> tuple[int, float]:
    """Expert parallelism's token all-to-alls per step: (bytes sent per rank, seconds)."""
    if compute is None or ep == 1:
        return 0, 0.0
    return all_to_all(compute, num_moe_blocks(groups), ep, gathered, num_ranks, net)


def micro_batches(compute: ComputeModel | None, activations: ActivationModel | None) -> int:
    """Micro-batches per step: a rank's tokens per step over one micro-batch's.

    1 without both models.

    Raises:
        ValueError: The tokens per step are not a whole number of micro-batches.
    """
    if compute is None or activations is None:
        return 1
    count, left = divmod(compute.tokens_per_rank, activations.tokens)
    if count < 1 or left:
        raise ValueError(
            f"tokens_per_rank {compute.tokens_per_rank:,} must be a whole number of "
            f"micro-batches of seq_len x micro_batch = {activations.tokens:,} tokens"
        )
    return count


def _timing(
    compute: ComputeModel,
    groups: Sequence[GroupSpec],
    checkpoint_ratio: tuple[int, int] | None,
    streamed_bytes: int,
    a2a_time: float,
    gathers: list[float],
    reduces: list[float],
    regather: list[float],
    prefetch: int,
    micro_batches: int = 1,
) -> dict[str, float]:
    """The compute, update and step time fields of an Estimate (`_compute.py`).

    Each micro-batch runs its share of the compute with every collective once more (FSDP's
    default schedule under gradient accumulation); the update runs once per step.
    """
    params = matmul_params(groups, compute.top_k)
    seq_len = compute.seq_len or 0
    per_token = [
        6 * p + 12 * attention_width(g) * seq_len for p, g in zip(params, groups, strict=True)
    ]
    work = [
        flops * compute.tokens_per_rank / compute.flops_per_second
        # A checkpointed block runs its forward again in backward.
        * (RECOMPUTE if is_checkpointed(block_index(g.name), checkpoint_ratio) else 1.0)
        for flops, g in zip(per_token, groups, strict=True)
    ]  # fmt: skip
    update = streamed_bytes / (compute.memory_gbps * 1e9)
    per_micro_batch = [w / micro_batches for w in work]
    overlapped = micro_batches * step_time(
        per_micro_batch, gathers, reduces, compute.overlap, regather, prefetch
    )
    return {
        "compute_time_s": sum(work),
        "step_time_s": overlapped + a2a_time + update + compute.host_overhead_s,
        "flops_per_token": sum(per_token),
        "optimizer_time_s": update,
        "host_s": compute.host_overhead_s,
    }


def _peak(
    groups: Sequence[GroupSpec],
    full: Sequence[int],
    shard_sizes: Sequence[int],
    element_bytes: tuple[int, int, int],
    activations: ActivationModel | None,
    prefetch: int,
    reshard_after_forward: bool,
    micro_batches: int,
) -> tuple[Peak, int]:
    """`step_peak` of the groups, and the most bytes gathered at once.

    `element_bytes`: bytes per element gathered, of the reduce-scatter input and of the
    sharded gradient. Backward makes a group's unsharded gradients in the compute dtype: as
    many bytes as it gathers.
    """
    compute_bytes, reduce_bytes, grad_bytes = element_bytes
    gathered = [f * compute_bytes for f in full]
    # At most prefetch + 1 adjacent groups gathered at once (every group, when kept).
    width = len(gathered) if not reshard_after_forward else prefetch + 1
    window = max(sum(gathered[i : i + width]) for i in range(max(1, len(gathered) - width + 1)))
    kept, extra = (
        activations.by_group(groups, compute_bytes=compute_bytes)
        if activations else ([0] * len(groups), [0] * len(groups))
    )  # fmt: skip
    peak = step_peak(
        [
            GroupBytes(g.name, f * compute_bytes, f * compute_bytes, f * reduce_bytes,
                       s * grad_bytes, a, e)
            for g, f, s, a, e in zip(groups, full, shard_sizes, kept, extra, strict=True)
        ],
        prefetch=prefetch,
        reshard_after_forward=reshard_after_forward,
        accumulating=micro_batches > 1,
    )  # fmt: skip
    return peak, window


_PLANS: OrderedDict[tuple[int, int, int, int], Layout] = OrderedDict()
_MAX_PLANS = 1024
# Each plan's optimizer state per rank, by (plan, optimizer, bytes): the plan kept beside it.
_STATE: OrderedDict[tuple[int, str, int], tuple[Layout, list[int]]] = OrderedDict()
_LAYOUTS: OrderedDict[tuple[object, ...], tuple[list[int], list[int]]] = OrderedDict()


_SPECS: OrderedDict[tuple[int, int], tuple[TensorSpec, ...]] = OrderedDict()


def _specs(group: GroupSpec, block_rows: int) -> tuple[TensorSpec, ...]:
    """`group.specs(block_rows)`, shared by the groups with its layout (the latest kept)."""
    key = (group.layout_id, block_rows)
    specs = _SPECS.get(key)
    if specs is None:
        specs = _SPECS[key] = group.specs(block_rows)
        if len(_SPECS) > _MAX_PLANS:
            _SPECS.popitem(last=False)
    return specs


def _plan(group: GroupSpec, block_rows: int, shard_size: int, align: int) -> Layout:
    """`plan_layout` of the group's specs, shared by every group with its layout.

    The most recent plans are kept: `advise` estimates the same layouts (embedding, dense
    blocks, head) at every granularity it tries. A layout's tensor names may be another
    group's with other indices, which nothing here reads.
    """
    key = (group.layout_id, block_rows, shard_size, align)
    layout = _PLANS.get(key)
    if layout is None:
        layout = plan_layout(_specs(group, block_rows), shard_size, align=align)
        _PLANS[key] = layout
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return layout


def estimate(
    groups: Sequence[GroupSpec],
    *,
    shard_size: int,
    replicate_size: int = 1,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    compute_bytes: int | None = None,
    optimizer: str = "adamw",
    block_rows: int = 1,
    align_bytes: int = 16,
    ranks_per_node: int = 8,
    intra_node_gbps: float = 400.0,
    inter_node_gbps: float = 50.0,
    latency_us: float = 20.0,
    hop_latency_us: float = 2.0,
    rails: int = 1,
    allow_idle_ranks: bool = False,
    compute: ComputeModel | None = None,
    expert_parallel: int = 1,
    activations: ActivationModel | None = None,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    dense_shard_size: int | None = None,
) -> Estimate:
    """Memory per rank and communication per step of FSDP over `shard_size` ranks (x replicas).

    Every group g is planned with `plan_layout` at W = shard_size (blocks of `block_rows`
    rows, S aligned to `align_bytes`, as DBuffer plans it), giving its shard size S_g.

    Per rank (b_p = param_bytes, b_g = grad_bytes, b_c = compute_bytes or b_p):
    - parameters: sum_g S_g b_p; gradients: sum_g S_g b_p (padding included: it is allocated;
      the sharded gradients keep the parameters' dtype, as FSDP2 and fsdp_engine keep them,
      whatever the reduce dtype);
    - optimizer state, per rank r, over the real elements n_r it holds (padding excluded):
      adamw 2 b_p n_r; sgd (momentum) b_p n_r; muon b_p per element of matrices (>= 2-D,
      names without embed/head/output) and 2 b_p elsewhere (its AdamW groups); adamw8bit
      2 bytes per element plus 2 x 4 bytes per 32 x 32 block touched for 2-D tensors of at
      least 4096 elements, 2 x 4 bytes per element for the rest;
    - unsharded: max_g W_g S_g b_c; with prefetch max_g (W_g S_g + W_g+1 S_g+1) b_c (prefetch
      p: p + 1 adjacent groups; without
      reshard_after_forward every group stays gathered from forward to backward: sum_g);
      reduce-scatter input max_g W_g S_g b_p, plus W_g S_g b_g when the reduce dtype differs
      (the gradients in the parameters' dtype, and their cast for the collective);
      activations (`activations`, `_activations.py`). These are each transient's largest;
      they do not coincide. W_g is W, or W / e for a group of experts under expert
      parallelism e;
    - the peak (`memory_bytes`): parameters + optimizer state + `peak`, the largest live set
      of the step's phases (`_peak.py`): in the backward of group g, the sharded gradients
      reduced so far, the activations of the groups before g and g's own (or its unsharded
      gradients, W_g S_g b_c, where larger), the gathered window and the reduce-scatter
      input of the group before, in flight; or the update, with every sharded gradient.
    Per step, sent by each rank (what ragged_placement's CommCounter counts; received alike):
    - all-gather: 2 per group (forward, and backward after resharding): 2 sum_g (W_g-1) S_g b_c
      (1 per group without reshard_after_forward);
    - reduce-scatter: sum_g (W_g-1) S_g b_g;
    - all-reduce over the replicas (HSDP, R > 1): sum_g S_g b_g.
    Predicted time: each collective is a ring: latency + steps x hop latency + wire bytes /
    bandwidth, with W-1 steps and wire bytes (W-1) S_g b for an all-gather or reduce-scatter,
    2 (R-1) steps and 2 (R-1)/R S_g b_g for the all-reduce; the bandwidth (per rank) is
    intra-node only when every group of the collective lies within one node (shard groups are
    consecutive ranks, replica groups strided by W; nodes hold `ranks_per_node` consecutive
    ranks), else inter-node: a group that straddles two nodes runs at the slower link.
    `comm_time_s` sums them (no overlap: an upper bound on exposed communication); with
    `compute`, `step_time_s` overlaps each group's collectives with its neighbours' compute
    and adds the optimizer update (`optimizer_time_s`; both in `_compute.py`), and
    `exposed_comm_s` is what compute does not hide.

    Args:
        groups: The model's FSDP groups (e.g. `load_preset(name).groups`).
        shard_size: W, ranks in each FSDP (shard) group.
        replicate_size: R, replicas (HSDP); R x W ranks in all.
        param_bytes: Bytes per stored parameter element (4: fp32).
        grad_bytes: Bytes per element of the gradient reduction (the reduce dtype: 2 for a
            bf16 reduce-scatter); the sharded gradients stay in the parameters' dtype.
        compute_bytes: Bytes per gathered element (2 for bf16 mixed precision); default
            param_bytes.
        optimizer: "adamw", "adamw8bit" (needs block_rows a multiple of 32), "muon" or "sgd".
        block_rows: Rows no shard boundary may cut.
        align_bytes: Each shard starts at a multiple of this many bytes.
        ranks_per_node: Ranks sharing a node's fast links.
        intra_node_gbps: Per-rank bandwidth inside a node, GB/s.
        inter_node_gbps: Per-rank bandwidth between nodes (one NIC), GB/s.
        latency_us: Fixed cost of one collective (launch and synchronization), microseconds.
        hop_latency_us: Cost of each of a ring's steps beyond its bytes, microseconds.
        rails: NICs per node a collective spreads its node-to-node hops over (NCCL's
            channels on a rail-optimized node: 8 on an 8-GPU node with a NIC per GPU; 1:
            each ring's hop through one rank's NIC).
        allow_idle_ranks: Accept a group with fewer blocks than W (some ranks then hold only
            padding, as a DBuffer does for a small group); by default that is an error.
        compute: Tokens per rank and the accelerator's speed: adds the compute time, the
            FLOPs per token and the step time with FSDP's overlap (`_compute.py`).
        expert_parallel: EP degree e (experts in groups of their own): each rank holds
            1/e of a block's experts, sharded over the W / e ranks that hold the same ones,
            and sends tokens to them (`_expert_parallel.py`; needs `compute` with top_k and
            hidden_size for the all-to-alls).
        activations: The batch a rank runs: adds the activations it keeps (with activation
            checkpointing of every block: their inputs, and forward computed twice).
        reshard_after_forward: Free each group after forward and gather it again for
            backward (FSDP's default); False keeps every group gathered in between.
        prefetch: Groups gathered ahead of the one computing (FSDP's default 1; more with
            `set_modules_to_forward_prefetch`): up to prefetch + 1 adjacent groups gathered.
        dense_shard_size: A MoE model's dense blocks (blocks without experts) sharded over
            this many consecutive ranks instead of W, their copies all-reduced (HSDP inside
            the shard group): their few, large blocks pad less over fewer ranks.

    Returns:
        The Estimate.

    Example:
        >>> from shard_planner import load_preset
        >>> est = estimate(load_preset("llama3-8b").groups, shard_size=8)
        >>> round(est.param_bytes / 2**30, 2), f"{est.padding_ratio:.4%}"
        (3.74, '0.0102%')
    """
    compute_model = compute
    shard_size = check_world_size("shard_size", shard_size)
    replicate_size = check_world_size("replicate_size", replicate_size)
    param_bytes, grad_bytes, gathered = check_element_bytes(
        param_bytes, grad_bytes, compute_bytes, align_bytes
    )
    block_rows = check_count("block_rows", block_rows, 1)
    ranks_per_node = check_count("ranks_per_node", ranks_per_node, 1)
    check_optimizer(optimizer, block_rows)
    check_links(intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps,
                 latency_us=latency_us, hop_latency_us=hop_latency_us)  # fmt: skip
    groups = check_groups(groups)
    check_models(compute_model, activations, reshard_after_forward)

    ep = check_expert_parallel(expert_parallel, shard_size, compute_model)
    original = groups
    groups_held, is_expert = expert_groups_under_ep(groups, ep)
    groups = tuple(groups_held)
    spans = _spans(original, is_expert, shard_size, ep, dense_shard_size)
    shard_sizes, optimizer_by_rank = _layouts(
        groups, spans, shard_size, block_rows, align_bytes // param_bytes, optimizer,
        param_bytes, allow_idle_ranks,
    )  # fmt: skip
    w, r = shard_size, replicate_size
    total, numel = sum(shard_sizes), sum(g.numel for g in original)
    full = [span.width * s for span, s in zip(spans, shard_sizes, strict=True)]  # gathered
    prefetch = check_count("prefetch", prefetch, 1)
    gathers_per_group = 2 if reshard_after_forward else 1
    # Every EP rank pads its own experts' layout: e copies of it cover the model's experts.
    covered = sum(f * (ep if expert else 1) for f, expert in zip(full, is_expert, strict=True))
    net = Net((intra_node_gbps * 1e9, inter_node_gbps * 1e9), latency_us, hop_latency_us,
              ranks_per_node, check_count("rails", rails, 1))  # fmt: skip
    gathers, reduces = collective_times(shard_sizes, spans, w, r, net, gathered, grad_bytes)
    ratio = activations.checkpoint_ratio if activations and activations.checkpointing else None
    micro = micro_batches(compute_model, activations)  # each gathers and reduces (FSDP's way)
    timing: dict[str, float] = {}
    a2a_bytes, a2a_time = _all_to_all(compute_model, groups, ep, gathered, w * r, net)
    if compute_model is not None:
        # The update reads parameters, gradients and state, and writes parameters and state.
        streamed = 3 * total * param_bytes + 2 * max(optimizer_by_rank)
        regather = gathers if reshard_after_forward else [0.0] * len(gathers)
        timing = _timing(compute_model, original, ratio, streamed, a2a_time,
                         gathers, reduces, regather, prefetch, micro)  # fmt: skip
    sent = [(span.width - 1) * s for span, s in zip(spans, shard_sizes, strict=True)]
    cast_bytes = grad_bytes if grad_bytes != param_bytes else 0  # the reduce dtype's copy
    copied = [s for span, s in zip(spans, shard_sizes, strict=True) if r * w > span.block]
    element_bytes = (gathered, param_bytes + cast_bytes, param_bytes)
    peak, window = _peak(original, full, shard_sizes, element_bytes, activations, prefetch,
                         reshard_after_forward, micro)  # fmt: skip
    return Estimate(
        shard_size=w,
        replicate_size=r,
        param_bytes=total * param_bytes,
        grad_bytes=total * param_bytes,
        optimizer_bytes=max(optimizer_by_rank),
        optimizer_bytes_by_rank=tuple(optimizer_by_rank),
        unsharded_bytes=max(full) * gathered,
        prefetch_unsharded_bytes=window,
        reduce_scatter_input_bytes=max(full) * (param_bytes + cast_bytes),
        all_gather_bytes=micro * gathers_per_group * sum(sent) * gathered,
        reduce_scatter_bytes=micro * sum(sent) * grad_bytes,
        all_reduce_bytes=micro * sum(copied) * grad_bytes,
        padding_elements=covered - numel,
        padding_bytes=(covered - numel) * param_bytes,
        numel=numel,
        comm_time_s=micro * (gathers_per_group * sum(gathers) + sum(reduces)) + a2a_time,
        peak=peak,
        expert_parallel=ep,
        all_to_all_bytes=a2a_bytes,
        activation_bytes=activations.bytes_for(original, compute_bytes=gathered)
        if activations else 0,
        checkpointing=ratio is not None,
        checkpoint_ratio=ratio or (1, 1),
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
        dense_shard_size=dense_shard_size,
        micro_batches=micro,
        slowest_collectives_s=(max(gathers, default=0.0), max(reduces, default=0.0)),
        **timing,
    )  # fmt: skip
