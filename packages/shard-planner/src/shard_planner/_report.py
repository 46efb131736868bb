"""Comparisons and renderings used by the CLI: padding tables, per-rank maps, plots.

Plots need matplotlib (the optional `plot` extra); everything else is plain text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shard_planner._baselines import flat_padding, fsdp2_padding, fsdp2_whole_block_padding
from shard_planner._bounds import ceil_to
from shard_planner._layout import Layout
from shard_planner._plan import plan_layout
from shard_planner._presets import ModelPreset


@dataclass(frozen=True)
class CaseResult:
    """Padding of one (world size, block rows) case over a whole model, in elements.

    Attributes:
        world_size: Ranks per group.
        block_rows: Rows per block.
        numel: Parameters in the model.
        padding: Our padding, summed over the groups.
        floor_padding: Padding if every group sat exactly at its lower bound.
        fsdp2: FSDP2 per-parameter padding (its even Shard(0) chunks cut blocks).
        fsdp2_blocks: FSDP2's padding if it kept the blocks whole (each tensor padded to
            block_rows x world_size rows; FSDP2 has no such option).
        flat: FSDP1-style flat padding (cuts blocks; not a valid layout for block_rows > 1).
        worst_bound_ratio: max over groups of S / lower_bound.
        worst_group: The group with that ratio.
        seconds: Wall time to plan every group.
    """

    world_size: int
    block_rows: int
    numel: int
    padding: int
    floor_padding: int
    fsdp2: int
    fsdp2_blocks: int
    flat: int
    worst_bound_ratio: float
    worst_group: str
    seconds: float


def compare_case(
    preset: ModelPreset, world_size: int, block_rows: int, align: int = 1
) -> CaseResult:
    """Plans every group of `preset` and sums the padding of ours and the baselines.

    Example:
        >>> from shard_planner import load_preset
        >>> case = compare_case(load_preset("llama3-8b"), world_size=64, block_rows=1)
        >>> case.worst_bound_ratio
        1.0
    """
    padding = floor = fsdp2 = fsdp2_blocks = flat = 0
    worst, worst_group = 1.0, "-"
    seconds = 0.0
    for group in preset.groups:
        specs = group.specs(block_rows)
        start = time.perf_counter()
        layout = plan_layout(specs, world_size, align=align)
        seconds += time.perf_counter() - start
        padding += layout.padding
        floor += world_size * layout.lower_bound - layout.total_numel
        fsdp2 += fsdp2_padding(specs, world_size)
        fsdp2_blocks += fsdp2_whole_block_padding(specs, world_size)
        flat += flat_padding(specs, world_size, align=align)
        ratio = layout.shard_size / layout.lower_bound if layout.lower_bound else 1.0
        if ratio > worst:
            worst, worst_group = ratio, group.name
    return CaseResult(
        world_size,
        block_rows,
        preset.numel,
        padding,
        floor,
        fsdp2,
        fsdp2_blocks,
        flat,
        worst,
        worst_group,
        seconds,
    )


def format_table(preset: ModelPreset, cases: Sequence[CaseResult]) -> str:
    """Renders compare results as a fixed-width table (padding as % of the model)."""

    def pct(value: int, total: int) -> str:
        return f"{100 * value / total:9.3f}%"

    head = (
        f"{'world':>6} {'rows':>5} {'ours':>10} {'floor':>10} {'fsdp2':>10} "
        f"{'fsdp2 whole':>12} {'flat':>10} {'S/bound':>8} {'plan s':>7}"
    )
    lines = [
        f"{preset.name}: {preset.numel / 1e9:.2f}B parameters in {len(preset.groups)} groups; "
        f"padding as % of the parameters (lower is better)",
        head,
    ]
    above = []
    for c in cases:
        lines.append(
            f"{c.world_size:>6} {c.block_rows:>5} {pct(c.padding, c.numel)} "
            f"{pct(c.floor_padding, c.numel)} {pct(c.fsdp2, c.numel)} "
            f"{pct(c.fsdp2_blocks, c.numel):>12} {pct(c.flat, c.numel)} "
            f"{c.worst_bound_ratio:>8.4f} {c.seconds:>7.3f}"
        )
        if c.worst_bound_ratio > 1.0:
            above.append(f"W={c.world_size}, {c.block_rows} rows: {c.worst_group}")
    lines.append(
        "ours: blocks of `rows` rows kept whole; floor: every group at its lower bound (no "
        "valid layout pads less); fsdp2: per-parameter Shard(0), which cuts blocks; fsdp2 "
        "whole: Shard(0) with each tensor padded to rows x W rows so that no block is cut "
        "(FSDP2 has no such option); flat: FSDP1-style, cuts blocks; S/bound: the largest "
        "group's shard size over its lower bound"
        + (f"; above 1 in {'; '.join(above)}" if above else " (1: every group at its bound)")
    )
    return "\n".join(lines)


def plot_cases(preset: ModelPreset, cases: Sequence[CaseResult], path: str) -> None:
    """Draws padding vs world size, like with like, into `path` (PNG).

    Per block size: ours beside FSDP2 keeping the same blocks whole (each tensor padded to
    rows x W rows); then FSDP2 as it runs (Shard(0), which cuts blocks) and flat sharding.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = ("tab:blue", "tab:green", "tab:purple", "tab:brown")
    all_rows = sorted({c.block_rows for c in cases})
    for rows, colour in zip(all_rows, colours * len(all_rows), strict=False):
        sub = sorted((c for c in cases if c.block_rows == rows), key=lambda c: c.world_size)
        xs = [c.world_size for c in sub]
        blocks = "rows whole" if rows == 1 else f"{rows}-row blocks whole"
        ax.plot(xs, [100 * c.padding / c.numel for c in sub], "o-", color=colour,
                label=f"ours, {blocks}")  # fmt: skip
        if rows > 1:
            label = f"FSDP2 Shard(0) padded to keep {rows}-row blocks whole"
            ax.plot(xs, [100 * c.fsdp2_blocks / c.numel for c in sub], "o--", color=colour,
                    alpha=0.6, label=label)  # fmt: skip
    first = sorted((c for c in cases if c.block_rows == all_rows[0]), key=lambda c: c.world_size)
    xs = [c.world_size for c in first]
    ax.plot(xs, [100 * c.fsdp2 / c.numel for c in first], "s--", color="tab:orange",
            label="FSDP2 Shard(0), rows whole (cuts larger blocks)")  # fmt: skip
    ax.plot(xs, [100 * c.flat / c.numel for c in first], "^:", color="tab:red",
            label="flat (FSDP1: cuts rows and blocks)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    # Padding spans 0 to thousands of percent and the interesting range is 0.01-10%: a log
    # axis with a small linear part around 0, and a labelled tick at each decade reached.
    ax.set_yscale("symlog", linthresh=0.01, linscale=0.5)
    top = max(100 * max(c.padding, c.fsdp2, c.fsdp2_blocks, c.flat) / c.numel for c in cases)
    ticks = [0.0] + [10.0**k for k in range(-2, 6) if 10.0 ** (k - 1) < max(top, 1.0)]
    ax.set_yticks(ticks, ["0"] + [f"{t:g}%" for t in ticks[1:]])
    ax.set_ylim(bottom=0, top=ticks[-1] * 1.5)
    ax.set_xlabel("FSDP world size (ranks per group)")
    ax.set_ylabel("padding, % of the model's parameters (lower is better)")
    ax.set_title(f"{preset.name}: padding by sharding scheme")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_layout(layout: Layout, *, max_ranks: int = 16, max_pieces: int = 8) -> str:
    """A per-rank text map of a layout: which tensors (and how many units) each rank holds."""
    size = layout.shard_size
    lines = [
        f"world_size={layout.world_size} shard_size={size} align={layout.align} "
        f"lower_bound={layout.lower_bound} padding={layout.padding} "
        f"({100 * layout.padding_ratio:.3f}%)",
        "each piece: tensor[lo:hi] = elements lo..hi of the rank's shard; xNu = N whole units "
        "(rows, or blocks of rows) of the tensor",
    ]
    order = sorted(layout.tensors, key=lambda s: layout.offsets[s.name])
    for rank in range(min(layout.world_size, max_ranks)):
        pieces = []
        used = 0
        for spec in order:
            lo, hi = layout.local_range(spec.name, rank)
            if hi > lo:
                pieces.append(f"{spec.name}[{lo}:{hi}]x{(hi - lo) // spec.unit}u")
                used += hi - lo
        if len(pieces) > max_pieces:  # keep one line per rank readable
            hidden = len(pieces) - max_pieces + 1
            pieces = [*pieces[: max_pieces - 2], f"...({hidden} more)...", pieces[-1]]
        lines.append(f"rank {rank:>5}: pad {size - used:>10}  " + " ".join(pieces))
    if layout.world_size > max_ranks:
        lines.append(f"... {layout.world_size - max_ranks} more ranks")
    return "\n".join(lines)


def explain_padding(layout: Layout) -> str | None:
    """Why a layout pads more than FSDP2's per-parameter Shard(0) would, and what helps.

    Returns None when it pads no more, or when a tensor has no shape (FSDP2's padding needs
    them).

    Example:
        >>> from shard_planner import TensorSpec, plan_layout
        >>> specs = [TensorSpec.from_shape("a", (1009, 777), block_rows=1009),
        ...          TensorSpec.from_shape("b", (513, 1009), block_rows=513)]
        >>> print(explain_padding(plan_layout(specs, world_size=8)))  # doctest: +ELLIPSIS
        pads 4,970,334 elements, more than FSDP2's 12,502: ... the largest block (a, 783,993 ...
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"explain_padding takes a Layout, got {type(layout).__name__}")
    if any(spec.shape is None for spec in layout.tensors):
        return None
    fsdp2 = fsdp2_padding(layout.tensors, layout.world_size)
    if layout.padding <= fsdp2:
        return None
    size = layout.shard_size
    forcing = [s for s in layout.tensors if s.numel >= 2 * size]
    grid = math.lcm(layout.align, *(s.atom for s in forcing)) if forcing else layout.align
    why = (
        f"pads {layout.padding:,} elements, more than FSDP2's {fsdp2:,}: "
        f"no shard boundary may cut a block"
    )
    largest = max(layout.tensors, key=lambda s: s.atom)
    if largest.atom > -(-layout.total_numel // layout.world_size):
        why += (
            f", and the largest block ({largest.name}, {largest.atom:,} elements) must sit on "
            f"one rank, so S >= {largest.atom:,} where an even split needs only "
            f"{-(-layout.total_numel // layout.world_size):,}"
        )
    if forcing:
        names = ", ".join(s.name for s in forcing[:3]) + (", ..." if len(forcing) > 3 else "")
        why += (
            f", and {len(forcing)} tensor(s) ({names}) hold a whole shard, so the shard size "
            f"S={size:,} must be a multiple of the lcm of their blocks, {grid:,}"
        )
        rest = [s for s in layout.tensors if s.numel < 2 * size and s.numel]
        pinned = max(rest, key=lambda s: s.numel, default=None)
        if pinned is not None and ceil_to(pinned.numel // 2 + 1, grid) == size:
            wider = math.lcm(grid, pinned.atom)
            why += (
                f"; a smaller S would put a whole shard inside {pinned.name} too, and S would "
                f"have to be a multiple of {wider:,}"
            )
    bound = "S is the lower bound: no layout of this group with these blocks pads less"
    if size > layout.lower_bound:
        bound = f"the lower bound is S={layout.lower_bound:,}"
    return (
        f"{why}; {bound}. What can help: another grouping (the tensors named here in groups "
        "of their own), a smaller FSDP world size, or fewer rows per block."
    )


def _common_prefix(names: Sequence[str]) -> str:
    """The dotted prefix ("model.layers.3.") every name shares; "" for fewer than two names."""
    if len(names) < 2:
        return ""
    parts = [name.split(".")[:-1] for name in names]
    shared = 0
    while all(len(p) > shared and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    return "".join(f"{part}." for part in parts[0][:shared])


def _label(name: str, common: str) -> str:
    label = name[len(common) :] if common else name
    return label.removesuffix(".weight") or name


def draw_layout(layout: Layout, path: str, *, title: str = "", max_ranks: int = 64) -> None:
    """Draws one bar per rank: tensors' pieces in colour, padding hatched, blocks ticked."""
    plt = _pyplot()
    num_ranks = min(layout.world_size, max_ranks)
    size = layout.shard_size or 1
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.32 * num_ranks))
    # 60 distinct colours before any repeats (tab20, tab20b, tab20c).
    palette = [plt.get_cmap(m)(i) for m in ("tab20", "tab20b", "tab20c") for i in range(20)]
    order = sorted(layout.tensors, key=lambda s: layout.offsets[s.name])
    colors = {spec.name: palette[i % len(palette)] for i, spec in enumerate(order)}
    # Labels drop the group's shared prefix but keep indices (expert 12 stays "experts.12.w1").
    common = _common_prefix([spec.name for spec in order])
    for rank in range(num_ranks):
        y = num_ranks - 1 - rank
        ax.barh(y, size, left=0, height=0.8, color="white", edgecolor="grey", hatch="//")
        for spec in order:
            lo, hi = layout.local_range(spec.name, rank)
            if hi <= lo:
                continue
            ax.barh(
                y, hi - lo, left=lo, height=0.8, color=colors[spec.name], edgecolor="black", lw=0.3
            )
            if (hi - lo) / size > 0.06:
                label = _label(spec.name, common)
                ax.text((lo + hi) / 2, y, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in reversed(range(num_ranks))], fontsize=7)
    ax.set_xlim(0, size)
    ax.set_xlabel("element offset within the rank's shard (hatched: padding)")
    heading = title or f"layout of {len(layout.tensors)} tensors on {layout.world_size} ranks"
    if num_ranks < layout.world_size:
        heading += f"\n(ranks 0-{num_ranks - 1} of {layout.world_size} shown)"
    ax.set_title(heading)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("drawing needs matplotlib: pip install 'shard-planner[plot]'") from None
    return plt
