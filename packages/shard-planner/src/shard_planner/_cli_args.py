"""The `shard-planner` command line's options and their types (`_cli.py` runs them).

Each type turns one argument into its value or raises argparse's error, which the parser
reports as one line naming the option and the value.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

from shard_planner._activations import check_ratio
from shard_planner._estimate_checks import OPTIMIZERS
from shard_planner._plan import ORDERS
from shard_planner._presets import preset_names
from shard_planner._spec import MAX_WORLD_SIZE


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """An integer >= 0, at most 1024 (a byte count per element)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"must be in [0, 1024], got {value}")
    return value


def checkpoint_ratio(text: str) -> tuple[int, int]:
    """'P/Q': checkpoint P of every Q blocks."""
    p, sep, q = text.partition("/")
    try:
        return check_ratio((int(p), int(q)) if sep else (0, 0))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected P/Q with integers 1 <= P <= Q <= 64 (e.g. 3/4), got {text!r}"
        ) from None


def ranks(text: str) -> int:
    """A rank count: an integer in [1, MAX_WORLD_SIZE]."""
    value = positive(text)
    if value > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WORLD_SIZE:,} ranks, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


MAX_GIB = 2.0**20  # per rank: a pebibyte; more is a typo, and int(GiB * 2**30) overflows


def gib(text: str) -> float:
    """A size in GiB per rank: a finite number >= 0, at most MAX_GIB."""
    value = positive_float(text)
    if value > MAX_GIB:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_GIB:,.0f} GiB per rank, got {text!r}"
        )
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


def count_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 0."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers >= 0, got {text!r}"
        )
    return [int(item) for item in items]


def positive_list(text: str, item_type: Callable[[str], int] = positive) -> list[int]:
    """A comma-separated list of integers >= 1 (each through `item_type`)."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        )
    return [item_type(item) for item in items]


def ranks_list(text: str) -> list[int]:
    """A comma-separated list of rank counts."""
    return positive_list(text, ranks)


def add_cost_options(p: argparse.ArgumentParser) -> None:
    """The options `estimate` and `advise` share: the model, bytes, links and compute."""
    _add_model_options(p)
    _add_link_options(p)
    _add_compute_options(p)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "file", nargs="?", help="a JSON group file (the README's 'Group files'), or --preset"
    )
    p.add_argument("--preset", help=f"a shipped model: {', '.join(preset_names())}")
    p.add_argument("--ranks-per-node", type=positive, default=8, help="ranks sharing a node")
    p.add_argument(
        "--block-rows", type=positive, default=1, help="rows per block: no shard cuts one"
    )
    p.add_argument(
        "--param-bytes", type=positive, default=4, help="bytes per sharded parameter element"
    )
    p.add_argument(
        "--grad-bytes", type=positive, default=4, help="bytes per reduced gradient element"
    )
    p.add_argument(
        "--compute-bytes",
        type=positive,
        help="bytes per gathered element (2: bf16 mixed precision; default: --param-bytes)",
    )
    p.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="adamw", help="whose state is counted"
    )


def _add_link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--intra-node-gbps",
        type=positive_float,
        default=400.0,
        help="GB/s one rank sends inside a node",
    )
    p.add_argument(
        "--inter-node-gbps",
        type=positive_float,
        default=50.0,
        help="GB/s one rank sends between nodes",
    )
    p.add_argument(
        "--latency-us", type=positive_float, default=20.0, help="microseconds per collective"
    )
    p.add_argument(
        "--hop-latency-us", type=positive_float, default=2.0, help="microseconds per ring step"
    )
    p.add_argument(
        "--rails",
        type=positive,
        default=1,
        help="NICs per node a collective spreads over (8: one per GPU of an 8-GPU node)",
    )
    p.add_argument(
        "--links",
        help="a calibration file (tools/calibrate_links.py): its fitted link figures "
        "replace the four above",
    )


def _add_compute_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokens-per-rank",
        type=positive,
        help="tokens per rank per step: adds compute and the step time with overlap",
    )
    p.add_argument("--top-k", type=positive, help="routed experts per token (MoE)")
    p.add_argument(
        "--hidden-size",
        type=positive,
        help="activation width sent to experts under EP (default: the preset's)",
    )
    p.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=989.0,
        help="one rank's peak TFLOP/s at the compute dtype (989: H100 SXM, bf16 dense)",
    )
    p.add_argument(
        "--mfu", type=positive_float, default=0.4, help="fraction of the peak the model reaches"
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=1.0,
        help="fraction of a group's collectives that hide behind compute, 0..1",
    )
    p.add_argument(
        "--memory-gbps", type=positive_float, default=3350.0, help="optimizer update's bandwidth"
    )
    p.add_argument(
        "--host-overhead-ms",
        type=positive_float,
        default=0.0,
        help="host work per step beyond compute and update, measured on one rank",
    )
    p.add_argument("--seq-len", type=positive, help="tokens per sequence: adds activations")
    p.add_argument("--micro-batch", type=positive, default=1, help="sequences per micro-batch")
    p.add_argument(
        "--activation-scale",
        type=positive_float,
        default=1.0,
        help="measured activations over the shape count (1: fused kernels)",
    )
    p.add_argument(
        "--loss-bytes-per-logit",
        type=non_negative,
        default=12,
        help="bytes the loss holds per logit in its backward (12: an fp32 cross-entropy's "
        "log-softmax output, its gradient and the logits' gradient; 0: a fused loss)",
    )
    p.add_argument("--json", help="also write the result as JSON to this file")


def add_advise_options(adv: argparse.ArgumentParser) -> None:
    """The options only `advise` has: the budget and the settings to search."""
    add_cost_options(adv)
    adv.add_argument("--ranks", type=ranks, required=True, help="ranks to split")
    adv.add_argument("--memory-gb", type=gib, required=True, help="memory per rank, GiB")
    adv.add_argument(
        "--activation-gb",
        type=gib,
        default=0.0,
        help="GiB per rank to keep for activations when --seq-len does not count them",
    )
    adv.add_argument(
        "--expert-parallel",
        type=count_list,
        help="EP degrees to try, e.g. 1,8,64 (default: 1, and powers of two up to 64 that "
        "divide the experts, when --tokens-per-rank and --top-k price the all-to-alls)",
    )
    adv.add_argument(
        "--expert-groups",
        type=count_list,
        help="groups per block's experts to try, e.g. 0 (blocks whole) or 0,2,8 "
        "(default: 0,1,2,4,8 where the model has experts)",
    )
    adv.add_argument(
        "--min-headroom",
        type=positive_float,
        default=0.1,
        help="fraction of memory a split should leave free to rank first",
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
        "--dense-shard-sizes",
        type=count_list,
        help="sub-mesh sizes to try for a MoE model's dense blocks (default: --ranks-per-node)",
    )
    adv.add_argument(
        "--prefetch",
        type=count_list,
        help="prefetch depths to try, e.g. 1,2 (default: 1, and 2 with --tokens-per-rank)",
    )
    adv.add_argument(
        "--all", action="store_true", help="print every split and setting, not the first 10"
    )
    adv.add_argument("--plot", help="padding and memory vs shard size, PNG (needs matplotlib)")


GROUP_FILE = "a JSON group file (the README's 'Group files' section), or use --preset"


def _add_layout_options(p: argparse.ArgumentParser) -> None:
    """Rows per block and alignment: what `plan` and `show` lay out with."""
    p.add_argument(
        "--block-rows",
        type=positive,
        default=1,
        help="rows per block: no shard boundary cuts one (32 for 32 x 32 quantization)",
    )
    p.add_argument("--align", type=positive, default=1, help="the shard size is a multiple of this")


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The options of `plan`."""
    p.add_argument("file", nargs="?", help=GROUP_FILE)
    p.add_argument("--preset", help=f"a shipped model: {', '.join(preset_names())}")
    p.add_argument(
        "--world-size", type=ranks, required=True, help="ranks each group is sharded over"
    )
    p.add_argument("--group", help="plan only this group (default: every group)")
    p.add_argument(
        "--allow-idle-ranks",
        action="store_true",
        help="plan a group with fewer blocks than ranks (some then hold only padding)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="auto",
        help="the order tensors are laid out in: auto tries the others and keeps the best",
    )
    p.add_argument(
        "--out", help="write the plan (each group's layout, JSON) here instead of a summary"
    )
    _add_layout_options(p)


def add_compare_options(p: argparse.ArgumentParser) -> None:
    """The options of `compare`."""
    p.add_argument("file", nargs="?", help=GROUP_FILE)
    p.add_argument("--preset", help=f"a shipped model: {', '.join(preset_names())}")
    p.add_argument(
        "--world-sizes",
        type=ranks_list,
        default=[8, 64, 256, 1024],
        help="FSDP world sizes to compare, comma-separated",
    )
    p.add_argument(
        "--block-rows",
        type=positive_list,
        default=[1],
        help="rows per block to compare, comma-separated (e.g. 1,32)",
    )
    p.add_argument("--align", type=positive, default=1, help="the shard size is a multiple of this")
    p.add_argument("--plot", help="also draw the table into this PNG (needs matplotlib)")


def add_show_options(p: argparse.ArgumentParser) -> None:
    """The options of `show`."""
    p.add_argument("file", nargs="?", help=GROUP_FILE + " (or --layout)")
    p.add_argument("--preset", help=f"a shipped model: {', '.join(preset_names())}")
    p.add_argument("--layout", help="a plan written by `plan --out`")
    p.add_argument("--group", help="group name (default: the first group)")
    p.add_argument("--world-size", type=ranks, default=8, help="ranks the group is sharded over")
    p.add_argument("--max-ranks", type=positive, default=16, help="ranks to print or draw")
    p.add_argument("--out", help="draw the layout into this PNG (needs matplotlib)")
    _add_layout_options(p)


def add_estimate_options(p: argparse.ArgumentParser) -> None:
    """The options of `estimate`."""
    add_cost_options(p)
    p.add_argument(
        "--shard-size", type=ranks, required=True, help="ranks each group is sharded over"
    )
    p.add_argument(
        "--replicate-size", type=ranks, default=1, help="replicas (HSDP); 1 is plain FSDP"
    )
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing of blocks"
    )
    p.add_argument(
        "--checkpoint-ratio",
        type=checkpoint_ratio,
        default=(1, 1),
        metavar="P/Q",
        help="with --checkpointing, checkpoint P of every Q blocks, spread evenly (1/1: all)",
    )
    p.add_argument(
        "--dense-shard-size",
        type=positive,
        help="shard a MoE model's dense blocks over this many ranks (HSDP inside the shard)",
    )
    p.add_argument(
        "--keep-gathered",
        action="store_true",
        help="reshard_after_forward=False: every group stays gathered until backward",
    )
