"""The `shard-planner` command line: plan, compare and show layouts; estimate and advise.

Every user error (unknown preset, world size < 1, bad JSON, ...) exits with status 2 and one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from shard_planner._activations import ActivationModel
from shard_planner._advise import Candidate, advise
from shard_planner._cli_args import (
    add_advise_options,
    add_compare_options,
    add_estimate_options,
    add_plan_options,
    add_show_options,
)
from shard_planner._compute import ComputeModel
from shard_planner._cost_report import (
    format_candidates,
    format_estimate,
    padding_note,
    plot_candidates,
    to_json,
)
from shard_planner._estimate import estimate
from shard_planner._estimate_checks import BlockTooLargeError, check_blocks_fit
from shard_planner._granularity import has_experts, num_experts
from shard_planner._layout import Layout, dump_plan, load_plan
from shard_planner._links import load_links, topology_line
from shard_planner._plan import plan_layout
from shard_planner._presets import (
    GroupSpec,
    ModelPreset,
    load_group_file,
    load_preset,
)
from shard_planner._recipe import layout_lines
from shard_planner._report import (
    compare_case,
    describe_layout,
    draw_layout,
    explain_padding,
    format_table,
    plot_cases,
)
from shard_planner._spec import MAX_WORLD_SIZE


class UsageError(Exception):
    """A user error reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line is what scripts and people need.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# A command reads its preset once (the 2.4T one takes a second to parse): the model and
# its recorded config come from the same load.
_preset = functools.lru_cache(maxsize=2)(load_preset)


def _load_model(args: argparse.Namespace) -> ModelPreset:
    if args.preset and args.file:
        raise UsageError(f"give a group file or --preset, not both ({args.file}, {args.preset})")
    if args.preset:
        return _preset(args.preset)
    if not args.file:
        raise UsageError("give a group file or --preset NAME")
    return load_group_file(args.file)


def _write(path: str, write: Callable[[str], object]) -> None:
    """Runs `write(path)`, turning a bad path into one line (missing folder, a directory)."""
    target = pathlib.Path(path)
    if target.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"cannot write {path}: folder {target.parent} does not exist")
    try:
        write(path)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None


def _select_group(model: ModelPreset, name: str | None) -> GroupSpec:
    if name is None:
        return model.groups[0]
    for group in model.groups:
        if group.name == name:
            return group
    raise UsageError(f"no group named {name!r}; valid: {_some([g.name for g in model.groups])}")


def _some(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names[:6]) + (f", ... ({len(names)} groups)" if len(names) > 6 else "")


def _cmd_plan(args: argparse.Namespace) -> None:
    model = _load_model(args)
    groups = [_select_group(model, args.group)] if args.group else list(model.groups)
    layouts = {}
    for group in groups:
        specs = group.specs(args.block_rows)
        if not args.allow_idle_ranks:
            check_blocks_fit(group, specs, args.world_size)
        layouts[group.name] = plan_layout(
            specs, args.world_size, align=args.align, order=args.order
        )
    if args.out:
        text = dump_plan(layouts) + "\n"
        _write(args.out, lambda path: pathlib.Path(path).write_text(text))
        print(f"wrote {len(layouts)} layout(s) to {args.out}")
        return
    # Groups of one shape (a model's identical layers) share one layout and one note: the
    # note is printed under the first of them, naming how many it stands for.
    shapes: dict[int, list[str]] = {}
    for group in groups:
        shapes.setdefault(group.layout_id, []).append(group.name)
    for group in groups:
        layout = layouts[group.name]
        ratio = layout.shard_size / layout.lower_bound if layout.lower_bound else 1.0
        print(
            f"{group.name}: {len(layout.tensors)} tensors, {layout.total_numel:,} elements, "
            f"shard_size={layout.shard_size:,} (lower bound {layout.lower_bound:,}, "
            f"x{ratio:.4f}), padding={layout.padding:,} ({100 * layout.padding_ratio:.3f}%)"
        )
        same = shapes[group.layout_id]
        explanation = explain_padding(layout) if same[0] == group.name else None
        if explanation:
            others = len(same) - 1
            also = f" (and for the {others} other groups of this shape)" if others else ""
            print(f"  note{also}: {explanation}")


def _check_picture(path: str | None, option: str) -> None:
    """Refuses a PNG target before any work: a missing folder, a directory, no matplotlib."""
    if path is None:
        return
    target = pathlib.Path(path)
    if target.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"cannot write {path}: folder {target.parent} does not exist")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            f"{option} needs matplotlib, which is not installed: pip install "
            f"'shard-planner[plot]' (or leave out {option})"
        )


def _cmd_compare(args: argparse.Namespace) -> None:
    _check_picture(args.plot, "--plot")
    model = _load_model(args)
    cases = [
        compare_case(model, world_size, rows, align=args.align)
        for rows in args.block_rows
        for world_size in args.world_sizes
    ]
    print(format_table(model, cases))
    if args.plot:
        _write(args.plot, lambda path: plot_cases(model, cases, path))
        print(f"wrote {args.plot}")


def _cmd_show(args: argparse.Namespace) -> None:
    _check_picture(args.out, "--out")
    if args.layout:
        if args.file or args.preset:
            raise UsageError("give --layout alone, without a group file or --preset")
        try:
            layouts = load_plan(pathlib.Path(args.layout).read_text())
        except OSError as exc:
            raise UsageError(f"cannot read {args.layout}: {exc.strerror}") from None
        if not layouts:
            raise UsageError(f"{args.layout} holds no groups: write one with `plan --out`")
        name = args.group or next(iter(layouts))
        if name not in layouts:
            raise UsageError(f"no group named {name!r} in {args.layout}; valid: {_some(layouts)}")
        layout: Layout = layouts[name]
        title = f"{args.layout}: {name}"
    else:
        group = _select_group(_load_model(args), args.group)
        layout = plan_layout(group.specs(args.block_rows), args.world_size, align=args.align)
        title = f"{group.name}, {args.block_rows} rows per block, {args.world_size} ranks"
    print(describe_layout(layout, max_ranks=args.max_ranks))
    if args.out:
        _write(
            args.out, lambda path: draw_layout(layout, path, title=title, max_ranks=args.max_ranks)
        )
        print(f"wrote {args.out}")


def _config_int(args: argparse.Namespace, key: str) -> int | None:
    """An integer from the preset's recorded config (e.g. hidden_size), if it has one."""
    if not getattr(args, "preset", None):
        return None
    value = _preset(args.preset).config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cost_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.links and args.rails != 1:
        raise UsageError(
            f"--rails {args.rails} with --links: a fitted bandwidth is what the collectives "
            f"achieved, NICs included; --rails multiplies the --inter-node-gbps given by hand"
        )
    links = load_links(args.links).options() if args.links else {}
    compute = None
    if args.tokens_per_rank:
        hidden = args.hidden_size or _config_int(args, "hidden_size")
        compute = ComputeModel(
            args.tokens_per_rank,
            args.top_k,
            args.peak_tflops,
            args.mfu,
            hidden,
            overlap=args.overlap,
            memory_gbps=args.memory_gbps,
            host_overhead_s=args.host_overhead_ms / 1e3,
            seq_len=args.seq_len,
        )
    activations = None
    if args.seq_len:
        activations = ActivationModel(
            args.seq_len,
            args.micro_batch,
            args.top_k,
            checkpointing=getattr(args, "checkpointing", False),
            checkpoint_ratio=getattr(args, "checkpoint_ratio", (1, 1)),
            scale=args.activation_scale,
            loss_bytes_per_logit=args.loss_bytes_per_logit,
        )
    return {
        "compute": compute,
        "activations": activations,
        "param_bytes": args.param_bytes,
        "grad_bytes": args.grad_bytes,
        "compute_bytes": args.compute_bytes,
        "optimizer": args.optimizer,
        "block_rows": args.block_rows,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
        "latency_us": args.latency_us,
        "hop_latency_us": args.hop_latency_us,
        "rails": args.rails,
        **links,
    }


def _cmd_estimate(args: argparse.Namespace) -> None:
    model = _load_model(args)
    options = _cost_options(args)
    est = estimate(
        model.groups,
        shard_size=args.shard_size,
        replicate_size=args.replicate_size,
        ranks_per_node=args.ranks_per_node,
        reshard_after_forward=not args.keep_gathered,
        dense_shard_size=args.dense_shard_size,
        **options,
    )
    print(f"{model.name}: {model.numel:,} parameters, {len(model.groups)} groups")
    print(topology_line(args.ranks_per_node, options, args.links))
    print(format_estimate(est))
    if args.json:
        import json
        from dataclasses import asdict

        text = json.dumps(asdict(est), indent=1)
        _write(args.json, lambda path: pathlib.Path(path).write_text(text))
        print(f"wrote {args.json}")


def _cmd_advise(args: argparse.Namespace) -> None:
    _check_picture(args.plot, "--plot")
    model = _load_model(args)
    memory = int(args.memory_gb * 2**30)
    search = {
        "expert_groups": args.expert_groups,
        "expert_parallel": args.expert_parallel,
        "optimizers": args.optimizers,
        "reduce_bytes": args.reduce_bytes,
        "reshard_after_forward": args.reshard_after_forward,
        "prefetch": args.prefetch,
        "dense_shard_sizes": args.dense_shard_sizes,
    }
    print(
        f"{model.name}: {model.numel:,} parameters on {args.ranks} ranks ({args.ranks_per_node} "
        f"per node), {args.memory_gb:g} GiB per rank, {args.block_rows} rows per block, "
        f"optimizer {args.optimizer}"
    )
    print(topology_line(args.ranks_per_node, _cost_options(args), args.links))
    try:
        candidates = _advise(model, args, memory, **search)
        if not candidates:  # nothing fits: every split's leanest settings, table and levers
            candidates = _advise(model, args, memory, include_all=True, **{**search, **_LEANEST})
    except BlockTooLargeError as err:  # no shard size can hold every group's blocks
        print(f"no (replicate, shard) split of {args.ranks} ranks shards every group: {err}")
        for line in _levers(model, args, memory):
            print(line)
        return
    print(format_candidates(candidates, memory, max_rows=None if args.all else 10))
    if not candidates:
        return
    print(padding_note(candidates))
    best = next((c for c in candidates if c.fits), None)
    if best is None:
        least = min(candidates, key=lambda c: c.memory_bytes)
        for line in _levers(model, args, memory, least):
            print(line)
    if best is not None:
        recipe = layout_lines(
            best, model.groups, args.block_rows,
            param_bytes=args.param_bytes, compute_bytes=args.compute_bytes,
        )  # fmt: skip
        print("\n".join(recipe))
    if args.json:
        text = to_json(candidates)
        _write(args.json, lambda path: pathlib.Path(path).write_text(text))
        print(f"wrote {args.json}")
    if args.plot:
        title = f"{model.name}, {args.ranks} ranks, {args.block_rows} rows per block"
        _write(args.plot, lambda path: plot_candidates(candidates, path, title, memory))
        print(f"wrote {args.plot}")


def _advise(
    model: ModelPreset,
    args: argparse.Namespace,
    memory: int,
    num_ranks: int | None = None,
    **overrides: Any,
) -> list[Candidate]:
    """`advise` with the command line's options, some replaced."""
    options: dict[str, Any] = {"min_headroom": args.min_headroom, **_cost_options(args)}
    return advise(
        model.groups,
        num_ranks=num_ranks or args.ranks,
        ranks_per_node=args.ranks_per_node,
        memory_bytes=memory,
        activation_bytes=int(args.activation_gb * 2**30),
        **{**options, **overrides},
    )


# Where only the least memory is asked for (nothing fits): deeper prefetch and groups kept
# gathered from forward to backward only add to it.
_LEANEST: dict[str, Any] = {"prefetch": [1], "reshard_after_forward": [True]}


def _levers(
    model: ModelPreset, args: argparse.Namespace, memory: int, least: Candidate | None = None
) -> list[str]:
    """When nothing fits: what each single change of the options would give (its best peak).

    A change is tried from the smallest peak's plan (its expert groups and EP degree) over
    every split of the ranks.
    """
    levers: list[tuple[str, dict[str, Any]]] = []
    if (args.compute_bytes or args.param_bytes) > 2:
        levers.append(("bf16 gathers (--compute-bytes 2)", {"compute_bytes": 2}))
    if args.grad_bytes > 2:
        levers.append(("bf16 gradient reduction (--grad-bytes 2)", {"grad_bytes": 2}))
    if args.optimizer == "adamw":
        rows = args.block_rows if args.block_rows % 32 == 0 else 32
        levers.append(
            (f"AdamW8bit (--optimizer adamw8bit --block-rows {rows})",
             {"optimizer": "adamw8bit", "block_rows": rows})
        )  # fmt: skip
    if args.expert_groups is not None and has_experts(model.groups):
        levers.append(("every expert granularity (no --expert-groups)", {}))
    if args.block_rows > 1:
        levers.append(("one-row blocks (--block-rows 1)", {"block_rows": 1}))
    lines = []
    for what, change in levers:
        kept: dict[str, Any] = {"expert_groups": None if not change else args.expert_groups}
        if change and least is not None:  # the one change, from the smallest peak's plan
            kept = {"expert_groups": [least.expert_groups],
                    "expert_parallel": [least.estimate.expert_parallel]}  # fmt: skip
        try:
            tried = _advise(model, args, memory, include_all=True, **kept, **_LEANEST, **change)
        except BlockTooLargeError:
            tried = []
        if not tried:
            lines.append(f"next lever: {what}: no split shards every group either")
            continue
        smallest = min(tried, key=lambda c: c.memory_bytes)
        verdict = "fits" if smallest.fits else "does not fit"
        lines.append(
            f"next lever: {what}: smallest peak {smallest.memory_bytes / 2**30:.1f} GiB "
            f"({smallest.replicate_size} x {smallest.shard_size}), {verdict}"
        )
    lines.append(_more_ranks(model, args, memory, least))
    if num_experts(model.groups) > 1 and args.tokens_per_rank is None:
        lines.append(
            "next lever: expert parallelism, searched once --tokens-per-rank and --top-k price "
            "its all-to-alls"
        )
    return lines


def _more_ranks(
    model: ModelPreset, args: argparse.Namespace, memory: int, least: Candidate | None
) -> str:
    """The rank count at which the smallest-peak split would fit, checked by one `advise`.

    More shards divide the sharded state (parameters, optimizer state, the gradients held
    at the peak) but not the transients (gathered groups, unsharded gradients,
    activations): from the split with the smallest peak, the shard count whose state fits
    beside them, rounded up to a power-of-two multiple of the ranks asked for.
    """
    if least is None:
        return "next lever: more ranks: no split of these ranks could be estimated"
    est = least.estimate
    state = est.param_bytes + est.optimizer_bytes + est.peak.grad_bytes
    transient = least.memory_bytes - state
    if transient >= memory:
        return (
            f"next lever: more ranks do not help: the gathered groups, unsharded gradients "
            f"and activations alone take {transient / 2**30:.1f} GiB per rank at any shard size"
        )
    factor = 1  # the state per rank halves with each doubling of the shard count
    while state / factor > memory - transient:
        factor *= 2
    ranks = args.ranks * max(factor, 2)
    if ranks > MAX_WORLD_SIZE:
        return f"next lever: more ranks: it would take over {MAX_WORLD_SIZE:,} ranks"
    try:
        found = _advise(model, args, memory, num_ranks=ranks)
    except BlockTooLargeError:
        found = []
    if not found:
        return f"next lever: more ranks: {ranks} ranks hold the sharded state, yet no split fits"
    best = found[0]
    return (
        f"next lever: more ranks: {ranks} fit ({best.replicate_size} x {best.shard_size}, "
        f"{best.memory_bytes / 2**30:.1f} GiB per rank)"
    )


class _FORMAT(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it has none (None or off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shard-planner",
        description="Plan block-aware, evenly sharded buffer layouts for FSDP groups.",
        formatter_class=_FORMAT,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser(
        "plan", help="plan the groups of a JSON group file or preset", formatter_class=_FORMAT
    )
    add_plan_options(plan)
    plan.set_defaults(run=_cmd_plan)

    compare = sub.add_parser(
        "compare", help="padding of ours vs FSDP2 vs flat, whole model", formatter_class=_FORMAT
    )
    add_compare_options(compare)
    compare.set_defaults(run=_cmd_compare)

    show = sub.add_parser(
        "show", help="render one group's layout per rank", formatter_class=_FORMAT
    )
    add_show_options(show)
    show.set_defaults(run=_cmd_show)

    est = sub.add_parser(
        "estimate",
        help="memory per rank and communication per step",
        description="Memory per rank (GiB) and what one rank sends per step (GiB), of one "
        "(replicate, shard) configuration.",
        formatter_class=_FORMAT,
    )
    add_estimate_options(est)
    est.set_defaults(run=_cmd_estimate)

    adv = sub.add_parser(
        "advise",
        help="rank every (replicate, shard) split of N ranks",
        description="Every (replicate, shard) split of --ranks and the settings searched, "
        "ranked; the first plan's memory by part (GiB per rank) and its fully_shard calls.",
        formatter_class=_FORMAT,
    )
    add_advise_options(adv)
    adv.set_defaults(run=_cmd_advise)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the process exit status (0 ok, 2 user error).

    Example:
        $ shard-planner compare --preset llama3-8b --world-sizes 8,1024 --block-rows 1,32
    """
    args = _parser().parse_args(argv)  # argparse itself exits 2 with one line on bad flags
    try:
        args.run(args)
    except (UsageError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"shard-planner: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shard-planner compare ... | head`
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
