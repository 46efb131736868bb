"""Compute per step from shapes, and the step time once FSDP overlaps its collectives.

FLOPs: a token runs every weight matrix of its path once forward (2 FLOPs per parameter)
and twice backward (4): 6 per parameter, over the matrices (2+ dims) that are not
embeddings (a lookup), and over routed experts only `top_k` of the model's experts. Attention
adds, given the sequence length s, 12 x d x s per token and attention block (QK^T and the
product with V, 2 x d x s each forward, twice that backward), d the query projection's
output width (`attention_width`); as torchtitan counts it, causal masking not discounted and
sliding windows counted whole. Time: FLOPs / (peak x MFU).

Step: FSDP gathers the next group while this one computes, and reduces a group's gradients
while the one before it runs backward. `step_time` runs the two streams: forward
(1/3 of a group's compute) waits for the group's gather, which starts once the group
`prefetch` before it has started (1: FSDP's default, so per group the slower of its forward
and the next gather counts: `ag_0 + sum_g max(fwd_g, ag_g+1)`); backward (2/3) runs the groups
in reverse, gathering each again `prefetch` ahead and reducing each as it ends (the first
gather and the last reduce are exposed). That is full overlap; where communication slows
compute (collectives that need the same cores or SMs), `overlap` < 1 shows that share of
what the streams hid (0: one after the other). The optimizer's update then streams the
rank's parameters, gradients and state through memory: `(2 params + grads + 2 state) bytes /
memory_gbps` (read all, write parameters and state), and `host_overhead_s` adds the host
work of a step (hooks, per-tensor dispatch).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from shard_planner._granularity import classify
from shard_planner._presets import GroupSpec, _Entry


@dataclass(frozen=True)
class ComputeModel:
    """How much a rank computes per step, and how fast.

    Attributes:
        tokens_per_rank: Tokens one rank processes per optimizer step (sequence length x
            micro-batch x micro-batches).
        top_k: Routed experts each token runs (needed when the model has experts).
        peak_tflops: The accelerator's dense peak in the compute dtype (989: H100 bf16).
        mfu: The fraction of peak the model's matmuls reach.
        hidden_size: The width of the activations sent to experts (expert parallelism).
        overlap: The fraction of the shorter of a group's compute and its collectives that
            runs at the same time as the other (1: FSDP's full overlap; a calibration
            measures it, `tools/validate_step.py`).
        memory_gbps: The memory bandwidth the optimizer update streams at, GB/s (3350:
            H100 HBM3).
        host_overhead_s: Host work per step that no FLOP or byte explains (the framework's
            hooks, the optimizer's per-tensor dispatch), seconds: what a one-rank step
            takes beyond its compute and update (`tools/validate_step.py` measures it).
        seq_len: Tokens per sequence, for attention's FLOPs (None: not counted).

    Example:
        >>> ComputeModel(tokens_per_rank=8192, mfu=0.5).flops_per_second
        494500000000000.0
    """

    tokens_per_rank: int
    top_k: int | None = None
    peak_tflops: float = 989.0
    mfu: float = 0.4
    hidden_size: int | None = None
    overlap: float = 1.0
    memory_gbps: float = 3350.0
    host_overhead_s: float = 0.0
    seq_len: int | None = None

    def __post_init__(self) -> None:
        tokens: object = self.tokens_per_rank  # user input: check what came
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens_per_rank must be an int >= 1, got {tokens!r}")
        seq_len: object = self.seq_len
        if seq_len is not None and (
            isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1
        ):
            raise ValueError(f"seq_len must be an int >= 1 or None, got {seq_len!r}")
        top_k: object = self.top_k
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
        ):
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
        for name, low, high in (
            ("peak_tflops", 0.0, math.inf),
            ("mfu", 0.0, 1.0),
            ("memory_gbps", 0.0, math.inf),
        ):
            value: object = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not low < value <= high or not math.isfinite(value):  # type: ignore[operator, arg-type]
                raise ValueError(
                    f"{name} must be a finite number in ({low}, {high}], got {value!r}"
                )
        overlap: object = self.overlap
        if (
            isinstance(overlap, bool)
            or not isinstance(overlap, int | float)
            or not (0.0 <= overlap <= 1.0)
        ):
            raise ValueError(f"overlap must be a number in [0, 1], got {overlap!r}")
        host: object = self.host_overhead_s
        if (
            isinstance(host, bool)
            or not isinstance(host, int | float)
            or not (0.0 <= host < math.inf)
        ):
            raise ValueError(f"host_overhead_s must be a finite number >= 0, got {host!r}")

    @property
    def flops_per_second(self) -> float:
        """What the matmuls reach: peak x MFU."""
        return self.peak_tflops * 1e12 * self.mfu


def matmul_params(
    groups: Sequence[GroupSpec], top_k: int | None, experts: int | None = None
) -> list[float]:
    """Per group, the parameters whose matmuls one token runs (routed experts: top_k of E).

    E is the model's expert count (`experts`, by default the largest expert index + 1, or a
    fused tensor's first dim), so a group holding some of a block's experts counts its share
    (give the groups as the model has them: under EP a rank's 1/e of the experts runs
    e times the tokens, the same FLOPs).

    Raises:
        ValueError: The model has routed experts and `top_k` is None or above E.
    """
    share = routed_share(groups, top_k, experts)
    out = []
    for group in groups:
        dense, routed = _matmul_split(group)
        out.append(dense + routed * share)
    return out


_QUERY = re.compile(r"(^|\.)(q_proj|wq|query|q_b_proj)\.weight$")
_FUSED_QKV = re.compile(r"(^|\.)(wqkv|qkv_proj|qkv|query_key_value)\.weight$")


def attention_width(group: GroupSpec) -> int:
    """The query projection's output width d (heads x head dim) of a group's attention.

    A fused q/k/v projection counts a third of its rows (equal q, k and v widths); 0 for a
    group without attention.

    Example:
        >>> attention_width(GroupSpec.from_shapes("layers.0", {
        ...     "layers.0.self_attn.q_proj.weight": (4096, 4096),
        ...     "layers.0.self_attn.k_proj.weight": (1024, 4096)}))
        4096
    """
    # By layout: names without their indices still say which tensor is the query, and a
    # model's blocks share a few layouts (a search meets thousands of expert groups).
    known = _ATTENTION.get(group.layout_id)
    if known is None:
        known = _ATTENTION[group.layout_id] = _attention_width(group)
    return known


_ATTENTION: dict[int, int] = {}


def _attention_width(group: GroupSpec) -> int:
    width = 0
    for entry in group.entries:
        if entry.shape is None or len(entry.shape) != 2:
            continue
        if _QUERY.search(entry.name):
            width += entry.shape[0]
        elif _FUSED_QKV.search(entry.name):
            width += entry.shape[0] // 3
    return width


def routed_share(
    groups: Sequence[GroupSpec], top_k: int | None, experts: int | None = None
) -> float:
    """The fraction of a block's routed experts one token runs: top_k / E (0 without experts).

    Raises:
        ValueError: The model has routed experts and `top_k` is None or above E.
    """
    num_experts = num_experts_in(groups) if experts is None else experts
    if not num_experts:
        return 0.0
    if top_k is None or top_k > num_experts:
        raise ValueError(
            f"the model routes tokens to {num_experts} experts: give top_k (how many each "
            f"token runs, 1..{num_experts}), got {top_k!r}"
        )
    return top_k / num_experts


def _matmul_split(group: GroupSpec) -> tuple[int, int]:
    """(matrix parameters every token runs, matrix parameters of routed experts).

    Kept by layout (names without indices, shapes): repeated layers count once.
    """
    known = _SPLITS.get(group.layout_id)
    if known is None:
        known = _SPLITS[group.layout_id] = _count_matmuls(group)
    return known


_SPLITS: dict[int, tuple[int, int]] = {}


def _count_matmuls(group: GroupSpec) -> tuple[int, int]:
    rest, per_expert, fused, _ = classify(group)
    dense = sum(e.numel for e in rest if _is_matmul(e))
    routed = sum(e.numel for entries in per_expert.values() for e in entries if _is_matmul(e))
    return dense, routed + sum(e.numel for e in fused if _is_matmul(e))


def step_time(
    compute_s: Sequence[float],
    all_gather_s: Sequence[float],
    reduce_s: Sequence[float],
    overlap: float = 1.0,
    regather_s: Sequence[float] | None = None,
    prefetch: int = 1,
) -> float:
    """The step time with FSDP's overlap (module docstring), groups in forward order.

    Compute and collectives run on two streams: group g's forward starts when its gather is
    done, and a gather may start once the group `prefetch` before it has started computing
    (at most `prefetch` + 1 groups gathered in forward); backward runs the groups in reverse,
    gathering each again `prefetch` groups ahead (the last group stays gathered) and reducing
    each when its backward ends. With `overlap` < 1, that share of what the streams hid shows.

    Args:
        compute_s: Each group's forward + backward compute, seconds.
        all_gather_s: Each group's all-gather, seconds (one; it runs twice).
        reduce_s: Each group's reduce-scatter plus HSDP all-reduce, seconds.
        overlap: How much of the shorter of compute and collectives hides (1: all).
        regather_s: Each group's all-gather for backward (default: `all_gather_s`; zeros
            when groups stay gathered after forward).
        prefetch: Groups gathered ahead of the one computing (FSDP's default: 1).

    Example:
        >>> step_time([3.0, 3.0], [1.0, 1.0], [1.0, 1.0])  # 1 + (1 + 1) + (2 + 2) + 1
        8.0
        >>> step_time([3.0, 3.0], [1.0, 1.0], [1.0, 1.0], overlap=0.0)  # 6 + 5 collectives
        11.0
    """
    n = len(compute_s)
    if not n:
        return 0.0
    regather = list(all_gather_s if regather_s is None else regather_s)
    regather[-1] = 0.0  # the last group's backward runs on its forward gather
    streams = _Streams()
    started: list[float] = []
    for g in range(n):  # forward
        ahead = started[g - prefetch] if g >= prefetch else 0.0
        gathered = streams.communicate(ahead, all_gather_s[g])
        started.append(streams.compute(gathered, compute_s[g] / 3))
    done = [0.0] * n  # when each group's backward gather ends
    for k in range(n - 2, max(-1, n - 2 - prefetch), -1):  # gathered as backward begins
        done[k] = streams.communicate(streams.compute_free, regather[k])
    for g in reversed(range(n)):
        start = streams.compute(done[g], 2 * compute_s[g] / 3)
        k = g - prefetch
        if g < n - 1 and k >= 0:
            done[k] = streams.communicate(start, regather[k])
        streams.communicate(streams.compute_free, reduce_s[g])
    both = max(streams.compute_free, streams.comm_free)
    total = sum(compute_s) + sum(all_gather_s) + sum(regather) + sum(reduce_s)
    return total - overlap * (total - both)


class _Streams:
    """A compute stream and a communication stream, each running its work in order."""

    def __init__(self) -> None:
        self.compute_free = 0.0
        self.comm_free = 0.0

    def compute(self, ready: float, seconds: float) -> float:
        """Runs `seconds` of compute once `ready`; returns when it started."""
        start = max(self.compute_free, ready)
        self.compute_free = start + seconds
        return start

    def communicate(self, issued: float, seconds: float) -> float:
        """Runs a collective issued at `issued`; returns when it ends."""
        self.comm_free = max(self.comm_free, issued) + seconds
        return self.comm_free


def _is_matmul(entry: _Entry) -> bool:
    dims = len(entry.shape) if entry.shape is not None else 1
    return dims >= 2 and "embed" not in entry.name


def num_experts_in(groups: Sequence[GroupSpec]) -> int:
    """The model's experts per block: the largest expert index + 1, or a fused first dim."""
    return max((_experts_in(group) for group in groups), default=0)


@functools.lru_cache(maxsize=4096)  # advise asks for every group at every split
def _experts_in(group: GroupSpec) -> int:
    _, per_expert, fused, _ = classify(group)
    most = max(per_expert) + 1 if per_expert else 0
    return max([most, *(entry.shape[0] for entry in fused if entry.shape)])
