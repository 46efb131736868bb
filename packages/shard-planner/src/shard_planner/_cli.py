"""The `shard-planner` command line: plan, compare and show layouts; estimate and advise.

Every user error (unknown preset, world size < 1, bad JSON, ...) exits with status 2 and one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from shard_planner._activations import ActivationModel
from shard_planner._advise import Candidate, advise
from shard_planner._compute import ComputeModel
from shard_planner._cost_report import (
    format_candidates,
    format_estimate,
    memory_parts,
    padding_note,
    plot_candidates,
    to_json,
)
from shard_planner._estimate import OPTIMIZERS, check_blocks_fit, estimate
from shard_planner._expert_parallel import expert_groups_under_ep
from shard_planner._granularity import fully_shard_calls, has_experts, split_experts
from shard_planner._layout import Layout, dump_plan, load_plan
from shard_planner._links import load_links
from shard_planner._plan import ORDERS, plan_layout
from shard_planner._presets import (
    GroupSpec,
    ModelPreset,
    load_group_file,
    load_preset,
    preset_names,
)
from shard_planner._report import (
    compare_case,
    describe_layout,
    draw_layout,
    explain_padding,
    format_table,
    plot_cases,
)


class UsageError(Exception):
    """A user error reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line is what scripts and people need.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _name_list(names: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in names]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(names)}, got {text!r}"
            )
        return items

    return parse


def _dtype_bytes_list(text: str) -> list[int]:
    sizes = {"fp32": 4, "bf16": 2, "fp16": 2}
    return [sizes[name] for name in _name_list(tuple(sizes))(text)]


def _bool_list(text: str) -> list[bool]:
    return [name == "true" for name in _name_list(("true", "false"))(text)]


def _count_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 0."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers >= 0, got {text!r}"
        )
    return [int(item) for item in items]


def _positive_list(text: str) -> list[int]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        )
    return [_positive(item) for item in items]


def _load_model(args: argparse.Namespace) -> ModelPreset:
    if args.preset and args.file:
        raise UsageError(f"give a group file or --preset, not both ({args.file}, {args.preset})")
    if args.preset:
        return load_preset(args.preset)
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
    for name, layout in layouts.items():
        ratio = layout.shard_size / layout.lower_bound if layout.lower_bound else 1.0
        print(
            f"{name}: {len(layout.tensors)} tensors, {layout.total_numel} elements, "
            f"shard_size={layout.shard_size} (lower bound {layout.lower_bound}, x{ratio:.4f}), "
            f"padding={layout.padding} ({100 * layout.padding_ratio:.3f}%)"
        )
        explanation = explain_padding(layout)
        if explanation:
            print(f"  note: {explanation}")


def _cmd_compare(args: argparse.Namespace) -> None:
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
    if args.layout:
        if args.file or args.preset:
            raise UsageError("give --layout alone, without a group file or --preset")
        try:
            layouts = load_plan(pathlib.Path(args.layout).read_text())
        except OSError as exc:
            raise UsageError(f"cannot read {args.layout}: {exc.strerror}") from None
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
    value = load_preset(args.preset).config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cost_options(args: argparse.Namespace) -> dict[str, Any]:
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
        )
    activations = None
    if args.seq_len:
        activations = ActivationModel(
            args.seq_len,
            args.micro_batch,
            args.top_k,
            checkpointing=getattr(args, "checkpointing", False),
            scale=args.activation_scale,
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
    est = estimate(
        model.groups,
        shard_size=args.shard_size,
        replicate_size=args.replicate_size,
        ranks_per_node=args.ranks_per_node,
        reshard_after_forward=not args.keep_gathered,
        **_cost_options(args),
    )
    print(f"{model.name}: {model.numel:,} parameters, {len(model.groups)} groups")
    print(format_estimate(est))
    if args.json:
        import json
        from dataclasses import asdict

        text = json.dumps(asdict(est), indent=1)
        _write(args.json, lambda path: pathlib.Path(path).write_text(text))
        print(f"wrote {args.json}")


def _cmd_advise(args: argparse.Namespace) -> None:
    model = _load_model(args)
    memory = int(args.memory_gb * 2**30)
    search = {
        "expert_groups": args.expert_groups,
        "expert_parallel": args.expert_parallel,
        "optimizers": args.optimizers,
        "reduce_bytes": args.reduce_bytes,
        "reshard_after_forward": args.reshard_after_forward,
        "prefetch": args.prefetch,
    }
    candidates = _advise(model, args, memory, **search)
    if not candidates:  # nothing fits: every split, for the table and the levers
        candidates = _advise(model, args, memory, include_all=True, **search)
    print(
        f"{model.name}: {model.numel:,} parameters on {args.ranks} ranks ({args.ranks_per_node} "
        f"per node), {args.memory_gb:g} GiB per rank, {args.block_rows} rows per block, "
        f"optimizer {args.optimizer}"
    )
    print(format_candidates(candidates, memory))
    print(padding_note(candidates))
    best = next((c for c in candidates if c.fits), None)
    if best is None:
        for line in _levers(model, args, memory):
            print(line)
    if best is not None:
        grouped = split_experts(model.groups, best.expert_groups)
        assert grouped is not None  # advise made it
        ep = best.estimate.expert_parallel
        print(f"memory of the first, per rank: {memory_parts(best.estimate)}")
        print(
            f"layout of the first: mesh ({best.replicate_size}, {best.shard_size}) "
            f"(replicate, shard), block_rows={args.block_rows}, then bottom-up:"
        )
        if ep > 1:  # what one rank holds: its 1/e of each block's experts, numbered from 0
            grouped = tuple(expert_groups_under_ep(grouped, ep)[0])
            dp = best.shard_size // ep
            shape = f"({best.replicate_size}, {dp})" if best.replicate_size > 1 else f"({dp},)"
            print(
                f"    # experts_mesh {shape}: the ranks holding the same experts, the 'dp' "
                f"axis of {best.shard_size} shard ranks as ({dp}, {ep}) ('dp', 'ep'); first "
                f"each block keeps its 1/{ep} of the experts over 'ep' (numbered from 0)"
            )
        calls = fully_shard_calls(grouped, experts_mesh="experts_mesh" if ep > 1 else None)
        if not best.estimate.reshard_after_forward:
            print("    # every call with reshard_after_forward=False (bound with the mesh)")
        if best.estimate.checkpointing:
            print("    # first, activation checkpointing of every block (checkpoint_wrapper)")
        if best.estimate.prefetch > 1:
            print(
                f"    # then each group prefetches the next {best.estimate.prefetch}: "
                f"set_modules_to_forward_prefetch / set_modules_to_backward_prefetch"
            )
        print("\n".join(f"    {line}" for line in calls))
        est = best.estimate
        if est.step_time_s and est.comm_time_s > 3 * est.compute_time_s:
            print(
                f"note: communication is {est.comm_time_s / est.compute_time_s:.0f}x the "
                f"compute of {est.compute_time_s:.2f} s per step: FSDP sends each parameter "
                f"three times per step (two gathers, one reduce), so with this few tokens "
                f"per rank no mesh split or grouping hides it; more tokens per rank, or "
                f"expert parallelism (--expert-parallel, priced with --top-k), is the lever"
            )
        if best.expert_groups:
            print(
                "    (an expert group gathers when one of its experts runs: every rank must "
                "run each group, e.g. call every expert, with no tokens if none are routed)"
            )
    if args.json:
        text = to_json(candidates)
        _write(args.json, lambda path: pathlib.Path(path).write_text(text))
        print(f"wrote {args.json}")
    if args.plot:
        title = f"{model.name}, {args.ranks} ranks, {args.block_rows} rows per block"
        _write(args.plot, lambda path: plot_candidates(candidates, path, title, memory))
        print(f"wrote {args.plot}")


def _advise(
    model: ModelPreset, args: argparse.Namespace, memory: int, **overrides: Any
) -> list[Candidate]:
    """`advise` with the command line's options, some replaced, every split included."""
    options: dict[str, Any] = {"min_headroom": args.min_headroom, **_cost_options(args)}
    return advise(
        model.groups,
        num_ranks=args.ranks,
        ranks_per_node=args.ranks_per_node,
        memory_bytes=memory,
        activation_bytes=int(args.activation_gb * 2**30),
        **{**options, **overrides},
    )


def _levers(model: ModelPreset, args: argparse.Namespace, memory: int) -> list[str]:
    """When nothing fits: what each single change of the options would give (its best peak)."""
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
    lines = []
    for what, change in levers:
        expert_groups = None if not change else args.expert_groups
        tried = _advise(
            model, args, memory, expert_groups=expert_groups, include_all=True, **change
        )
        least = min(tried, key=lambda c: c.memory_bytes)
        verdict = "fits" if least.fits else "does not fit"
        lines.append(
            f"next lever: {what}: smallest peak {least.memory_bytes / 2**30:.1f} GiB "
            f"({least.replicate_size} x {least.shard_size}), {verdict}"
        )
    return lines


def _add_cost_options(p: argparse.ArgumentParser) -> None:
    """The options `estimate` and `advise` share: the model, bytes, links and compute."""
    p.add_argument("file", nargs="?", help="group file (or use --preset)")
    p.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    p.add_argument("--ranks-per-node", type=_positive, default=8)
    p.add_argument("--block-rows", type=_positive, default=1)
    p.add_argument("--param-bytes", type=_positive, default=4)
    p.add_argument("--grad-bytes", type=_positive, default=4)
    p.add_argument("--compute-bytes", type=_positive, help="bytes gathered per element")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--intra-node-gbps", type=_positive_float, default=400.0)
    p.add_argument("--inter-node-gbps", type=_positive_float, default=50.0)
    p.add_argument("--latency-us", type=_positive_float, default=20.0, help="per collective")
    p.add_argument("--hop-latency-us", type=_positive_float, default=2.0, help="per ring step")
    p.add_argument(
        "--rails",
        type=_positive,
        default=1,
        help="NICs per node a collective spreads over (8: one per GPU of an 8-GPU node)",
    )
    p.add_argument(
        "--tokens-per-rank",
        type=_positive,
        help="tokens per rank per step: adds compute and the step time with overlap",
    )
    p.add_argument("--top-k", type=_positive, help="routed experts per token (MoE)")
    p.add_argument(
        "--hidden-size",
        type=_positive,
        help="activation width sent to experts under EP (default: the preset's)",
    )
    p.add_argument("--peak-tflops", type=_positive_float, default=989.0)
    p.add_argument("--mfu", type=_positive_float, default=0.4)
    p.add_argument(
        "--overlap",
        type=float,
        default=1.0,
        help="fraction of a group's collectives that hide behind compute, 0..1",
    )
    p.add_argument(
        "--memory-gbps", type=_positive_float, default=3350.0, help="optimizer update's bandwidth"
    )
    p.add_argument(
        "--links",
        help="a calibration file (tools/calibrate_links.py): its fitted link figures "
        "replace the four above",
    )
    p.add_argument("--seq-len", type=_positive, help="tokens per sequence: adds activations")
    p.add_argument("--micro-batch", type=_positive, default=1, help="sequences per micro-batch")
    p.add_argument(
        "--activation-scale",
        type=_positive_float,
        default=1.0,
        help="measured activations over the shape count (1: fused kernels)",
    )
    p.add_argument("--json", help="also write the result as JSON here")


def _add_advise(sub: Any) -> None:
    adv = sub.add_parser("advise", help="rank every (replicate, shard) split of N ranks")
    _add_cost_options(adv)
    adv.add_argument("--ranks", type=_positive, required=True)
    adv.add_argument("--memory-gb", type=_positive_float, required=True, help="GiB per rank")
    adv.add_argument("--activation-gb", type=_positive_float, default=0.0)
    adv.add_argument(
        "--expert-parallel",
        type=_count_list,
        help="EP degrees to try, e.g. 1,8,64 (default: 1, and powers of two up to 64 that "
        "divide the experts, when --tokens-per-rank and --top-k price the all-to-alls)",
    )
    adv.add_argument(
        "--expert-groups",
        type=_count_list,
        help="groups per block's experts to try, e.g. 0 (blocks whole) or 0,2,8 "
        "(default: 0,1,2,4,8 where the model has experts)",
    )
    adv.add_argument(
        "--min-headroom",
        type=_positive_float,
        default=0.1,
        help="fraction of memory a split should leave free to rank first (default 0.1)",
    )
    adv.add_argument(
        "--optimizers",
        type=_name_list(OPTIMIZERS),
        help=f"optimizers to try, e.g. adamw,adamw8bit (of {', '.join(OPTIMIZERS)})",
    )
    adv.add_argument(
        "--reduce-dtypes",
        dest="reduce_bytes",
        type=_dtype_bytes_list,
        help="gradient reduction dtypes to try, e.g. fp32,bf16 (default: --grad-bytes)",
    )
    adv.add_argument(
        "--reshard-after-forward",
        type=_bool_list,
        help="settings to try, e.g. true (default: true, and false where the model fits gathered)",
    )
    adv.add_argument(
        "--prefetch",
        type=_count_list,
        help="prefetch depths to try, e.g. 1,2 (default: 1, and 2 with --tokens-per-rank)",
    )
    adv.add_argument("--plot", help="padding and memory vs shard size, PNG (needs matplotlib)")
    adv.set_defaults(run=_cmd_advise)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shard-planner",
        description="Plan block-aware, evenly sharded buffer layouts for FSDP groups.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--block-rows", type=_positive, default=1, help="rows per block (default 1)")
        p.add_argument("--align", type=_positive, default=1, help="shard size alignment, elements")

    plan = sub.add_parser("plan", help="plan the groups of a JSON group file or preset")
    plan.add_argument("file", nargs="?", help="group file (see shard_planner._presets)")
    plan.add_argument("--preset", help=f"a shipped preset: {', '.join(preset_names())}")
    plan.add_argument("--world-size", type=_positive, required=True)
    plan.add_argument("--group", help="plan only this group")
    plan.add_argument(
        "--allow-idle-ranks",
        action="store_true",
        help="plan a group with fewer blocks than ranks (some then hold only padding)",
    )
    plan.add_argument("--order", choices=ORDERS, default="auto")
    plan.add_argument(
        "--out", help="write the plan (each group's layout, JSON) here instead of a summary"
    )
    common(plan)
    plan.set_defaults(run=_cmd_plan)

    compare = sub.add_parser("compare", help="padding of ours vs FSDP2 vs flat, whole model")
    compare.add_argument("file", nargs="?", help="group file (or use --preset)")
    compare.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    compare.add_argument("--world-sizes", type=_positive_list, default=[8, 64, 256, 1024])
    compare.add_argument("--block-rows", type=_positive_list, default=[1])
    compare.add_argument("--align", type=_positive, default=1)
    compare.add_argument("--plot", help="also draw the table into this PNG (needs matplotlib)")
    compare.set_defaults(run=_cmd_compare)

    show = sub.add_parser("show", help="render one group's layout per rank")
    show.add_argument("file", nargs="?", help="group file (or use --preset / --layout)")
    show.add_argument("--preset")
    show.add_argument("--layout", help="a plan written by `plan --out`")
    show.add_argument("--group", help="group name (default: the first group)")
    show.add_argument("--world-size", type=_positive, default=8)
    show.add_argument("--max-ranks", type=_positive, default=16)
    show.add_argument("--out", help="draw the layout into this PNG (needs matplotlib)")
    common(show)
    show.set_defaults(run=_cmd_show)

    est = sub.add_parser("estimate", help="memory per rank and communication per step")
    _add_cost_options(est)
    est.add_argument("--shard-size", type=_positive, required=True)
    est.add_argument("--replicate-size", type=_positive, default=1)
    est.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing of every block"
    )
    est.add_argument(
        "--keep-gathered",
        action="store_true",
        help="reshard_after_forward=False: every group stays gathered until backward",
    )
    est.set_defaults(run=_cmd_estimate)

    _add_advise(sub)
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
