"""Tables, JSON and plots for `estimate` and `advise` (the CLI's output)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from shard_planner._advise import Candidate
from shard_planner._estimate import Estimate

_GIB = 2**30


def format_estimate(est: Estimate) -> str:
    """A two-column table of one estimate (GiB per rank; traffic is what one rank sends)."""
    rows = [
        ("ranks", f"{est.replicate_size} replicas x {est.shard_size} shards = {est.num_ranks}"),
        ("parameters per rank", f"{est.param_bytes / _GIB:.3f} GiB"),
        ("gradients per rank", f"{est.grad_bytes / _GIB:.3f} GiB"),
        ("optimizer state per rank (max)", f"{est.optimizer_bytes / _GIB:.3f} GiB"),
        ("largest group unsharded", f"{est.unsharded_bytes / _GIB:.3f} GiB"),
        (
            "two adjacent groups unsharded"
            if est.reshard_after_forward
            else "every group unsharded (kept gathered)",
            f"{est.prefetch_unsharded_bytes / _GIB:.3f} GiB",
        ),
        ("reduce-scatter input (largest)", f"{est.reduce_scatter_input_bytes / _GIB:.3f} GiB"),
        (
            "activations"
            + (f" (checkpointing {checkpointed_blocks(est)})" if est.checkpointing else ""),
            f"{est.activation_bytes / _GIB:.3f} GiB",
        ),
        (
            "peak per rank" + ("" if est.activation_bytes else ", no activations"),
            f"{est.memory_bytes / _GIB:.3f} GiB",
        ),
        ("  at the peak", memory_parts(est)),
        (
            "micro-batches per step",
            f"{est.micro_batches} (each gathers and reduce-scatters: FSDP's default)",
        ),
        ("all-gather sent per rank per step", f"{est.all_gather_bytes / _GIB:.3f} GiB"),
        ("reduce-scatter sent per rank per step", f"{est.reduce_scatter_bytes / _GIB:.3f} GiB"),
        ("all-reduce sent per rank per step", f"{est.all_reduce_bytes / _GIB:.3f} GiB"),
        ("padding", f"{est.padding_elements:,} elements ({100 * est.padding_ratio:.3f}%)"),
        ("predicted communication per step", f"{est.comm_time_s:.3f} s (no overlap)"),
        ("one all-gather, slowest group", f"{est.slowest_collectives_s[0] * 1e3:.1f} ms"),
        ("one reduce, slowest group", f"{est.slowest_collectives_s[1] * 1e3:.1f} ms"),
    ]
    if est.step_time_s:
        rows += [
            ("FLOPs per token", f"{est.flops_per_token:.4g}"),
            ("compute per step", f"{est.compute_time_s:.3f} s"),
            ("optimizer update", f"{est.optimizer_time_s:.3f} s"),
            ("step, collectives overlapped", f"{est.step_time_s:.3f} s"),
            ("host work per step", f"{est.host_s:.3f} s"),
            ("exposed communication", f"{est.exposed_comm_s:.3f} s"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_candidates(
    candidates: Sequence[Candidate], memory_bytes: int, *, max_rows: int | None = None
) -> str:
    """The ranking as a markdown table; splits that do not fit are marked.

    With `max_rows`, the first rows only, and a line saying how many were left out.
    """
    timed = any(c.estimate.step_time_s for c in candidates)
    step = "step s | compute s | " if timed else ""
    lines = [
        f"| rank | replicate x shard | groups | {step}comm s/step | padding | memory GiB/rank "
        "| headroom | fits |",
        "| --- " * (8 + 2 * timed) + "|",
    ]
    shown = candidates if max_rows is None else candidates[:max_rows]
    for i, c in enumerate(shown, 1):
        est = c.estimate
        times = f"{est.step_time_s:.3f} | {est.compute_time_s:.3f} | " if timed else ""
        lines.append(
            f"| {i if c.fits else '-'} | {c.replicate_size} x {c.shard_size} | "
            f"{plan_name(c)} | {times}"
            f"{est.comm_time_s:.3f} | {100 * est.padding_ratio:.2f}% | "
            f"{c.memory_bytes / _GIB:.1f} | {100 * c.headroom:.0f}% | "
            f"{'yes' if c.fits else 'no'} |"
        )
    if len(shown) < len(candidates):
        lines.append(f"... {len(candidates) - len(shown):,} more rows (--all prints every row)")
    fitting = [c for c in candidates if c.fits]
    if not candidates:
        lines.append(
            "no (replicate, shard) split could be estimated with these settings (every shard "
            "size was refused: too few blocks for its ranks, or a degree that divides none)"
        )
    elif not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes)
        lines.append(
            f"no split fits in {memory_bytes / _GIB:.1f} GiB per rank; the smallest peak is "
            f"{least.memory_bytes / _GIB:.1f} GiB ({least.replicate_size} x "
            f"{least.shard_size}), of which the largest group alone takes "
            f"{least.estimate.unsharded_bytes / _GIB:.1f} GiB unsharded"
        )
    return "\n".join(lines)


def memory_parts(est: Estimate) -> str:
    """The peak per rank by part, in one line (GiB)."""
    peak = est.peak
    parts = [
        ("parameters", est.param_bytes),
        ("optimizer", est.optimizer_bytes),
        ("gradients", peak.grad_bytes),
        ("activations", peak.activation_bytes),
        ("gathered", peak.gathered_bytes),
        ("unsharded gradients", peak.reduce_input_bytes),
    ]
    if peak.update_bytes:
        parts.append(("update", peak.update_bytes))
    text = ", ".join(f"{name} {nbytes / _GIB:.1f}" for name, nbytes in parts)
    return f"{text} = {est.memory_bytes / _GIB:.1f} GiB (at the peak: {peak.phase})"


def checkpointed_blocks(est: Estimate) -> str:
    """Which blocks an estimate checkpoints, in words and as a rule on the block index i.

    Example:
        >>> from dataclasses import replace
        >>> from shard_planner import estimate, load_preset
        >>> est = estimate(load_preset("llama3-8b").groups[:3], shard_size=2)
        >>> checkpointed_blocks(est)
        'every block'
        >>> checkpointed_blocks(replace(est, checkpoint_ratio=(3, 4)))
        '3 of every 4 blocks (block i when (i + 1) * 3 // 4 > i * 3 // 4)'
    """
    p, q = est.checkpoint_ratio
    if p == q:
        return "every block"
    return f"{p} of every {q} blocks (block i when (i + 1) * {p} // {q} > i * {p} // {q})"


def plan_name(candidate: Candidate) -> str:
    """The grouping and every setting that differs from FSDP's defaults and AdamW in fp32."""
    est = candidate.estimate
    parts = [granularity_name(candidate.expert_groups, est.expert_parallel)]
    if est.checkpointing:
        p, q = est.checkpoint_ratio
        parts.append("AC" if p == q else f"AC {p}/{q}")
    if not est.reshard_after_forward:
        parts.append("kept gathered")
    if est.prefetch > 1:
        parts.append(f"prefetch {est.prefetch}")
    if est.dense_shard_size is not None:
        parts.append(f"dense blocks on {est.dense_shard_size}")
    if candidate.optimizer != "adamw":
        parts.append(candidate.optimizer)
    if candidate.grad_bytes != 4:
        parts.append(f"{8 * candidate.grad_bytes}-bit reduce")
    return ", ".join(parts)


def granularity_name(expert_groups: int, expert_parallel: int = 1) -> str:
    """How blocks are grouped: "blocks" whole, "experts apart", "experts in k", ", EP e"."""
    if expert_groups == 0:
        return "blocks"
    name = "experts apart" if expert_groups == 1 else f"experts in {expert_groups}"
    return name if expert_parallel == 1 else f"{name}, EP {expert_parallel}"


def padding_note(candidates: Sequence[Candidate], threshold: float = 0.03) -> str:
    """Which shard sizes keep padding under `threshold` (a fraction), in one line.

    A size counts as under it when some candidate of that size (some grouping) is.
    """
    least: dict[int, float] = {}
    for c in candidates:
        least[c.shard_size] = min(least.get(c.shard_size, 1.0), c.estimate.padding_ratio)
    good = sorted(size for size, ratio in least.items() if ratio < threshold)
    bad = sorted(size for size, ratio in least.items() if ratio >= threshold)
    return (
        f"padding under {100 * threshold:g}% at shard sizes {good or 'none'}; "
        f"at or above it at {bad or 'none'}"
    )


def to_json(candidates: Sequence[Candidate]) -> str:
    """Every candidate with its full estimate, as JSON."""
    out: list[dict[str, Any]] = []
    for c in candidates:
        record = asdict(c)
        record["estimate"].pop("optimizer_bytes_by_rank")  # one entry per rank: too long
        record["estimate"]["padding_ratio"] = c.estimate.padding_ratio
        out.append(record)
    return json.dumps(out, indent=1)


def plot_candidates(
    candidates: Sequence[Candidate], path: str, title: str, memory_bytes: int | None = None
) -> None:
    """Padding and memory per rank against the shard size, with the budget (needs matplotlib)."""
    from shard_planner._report import _pyplot

    plt = _pyplot()
    ordered = sorted(candidates, key=lambda c: c.shard_size)
    sizes = [c.shard_size for c in ordered]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(sizes, [100 * c.estimate.padding_ratio for c in ordered], "o-", color="tab:red")
    left.set_xscale("log", base=2)
    left.set_xlabel("shard size W (ranks per FSDP group)")
    left.set_ylabel("padding, % of parameters", color="tab:red")
    right = left.twinx()
    right.plot(sizes, [c.memory_bytes / _GIB for c in ordered], "s--", color="tab:blue")
    right.set_yscale("log")
    right.set_ylabel("peak memory per rank, GiB (log)", color="tab:blue")
    if memory_bytes is not None:
        right.axhline(memory_bytes / _GIB, color="tab:blue", linewidth=0.8, linestyle=":")
        right.annotate("memory per rank", (sizes[0], memory_bytes / _GIB), color="tab:blue")
    left.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
