"""What a run of train.py reads before it trains: the command line and the text.

`parse_args` and `check_args` (bad input: one line and exit status 2, before any rank starts
work), and `Text`, the character-level data: the last 10% held out for validation, every
rank drawing the same global batch for a step.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import NoReturn

import torch
from checkpoints import CheckpointError, Found, check_resumable, find, newest, run_settings
from pipeline import SCHEDULES

DATA = pathlib.Path(__file__).parent / "data" / "tinyshakespeare.txt"
DESCRIPTION = "Train a small Llama-style decoder on Shakespeare with fsdp_engine or torch FSDP2."


# -- command line -------------------------------------------------------------------------------


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Bad arguments: one line (`--help` shows the usage), exit status 2."""
        self.exit(2, f"train.py: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = _Parser(description=DESCRIPTION)
    parser.add_argument("--engine", choices=["ours", "fsdp2"], default="ours")
    parser.add_argument(
        "--optimizer",
        choices=["flat-adamw", "adamw", "muon", "adamw8bit"],
        default=None,
        help="flat-adamw (default with --engine ours): ragged_optimizers.AdamW, torch's AdamW "
        "stepping each run of adjacent shards as one tensor; adamw (default with fsdp2): "
        "torch.optim.AdamW (foreach); muon: Muon on the blocks' matrices, AdamW on the rest; "
        "adamw8bit: 8-bit moments",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nproc", type=int, default=0, help="start this many local ranks")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--moe", type=int, default=0, help="experts per layer (0: dense)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (dense only)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (with --moe)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (one per rank group)")
    parser.add_argument("--pp-schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4, help="per step, with --pp")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    parser.add_argument(
        "--gather",
        choices=["param", "fp8"],
        default="param",
        help="all-gather the weights in param_dtype, or as fp8 codes with one scale per 32 x "
        "128 block (--engine ours; exact because shards hold whole blocks)",
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--data", type=pathlib.Path, default=DATA)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build/demo"))
    parser.add_argument(
        "--checkpoint",
        type=pathlib.Path,
        help="save checkpoints in this folder (one step-N folder each, at the end and every "
        "--checkpoint-every steps); if it holds one already, continue from the newest",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between saves (0: at the end)"
    )
    parser.add_argument(
        "--keep-checkpoints", type=int, default=2, help="how many of the newest to keep"
    )
    parser.add_argument(
        "--resume",
        type=pathlib.Path,
        help="continue from this checkpoint (a step-N folder, or a --checkpoint folder: its "
        "newest)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-chars", type=int, default=300)
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="instead of training: time N rounds of ours and FSDP2 alternated in one run "
        "(examples/alternate.py), written to <out>/timing.json",
    )
    args = parser.parse_args(argv)
    if args.optimizer is None:  # the same arithmetic either way: each engine's fast one
        args.optimizer = "flat-adamw" if args.engine == "ours" else "adamw"
    args.pp_mesh = None  # set by build() with --pp
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raises UsageError for input no run can use (before any rank starts work)."""
    if not args.data.is_file():
        raise UsageError(f"data file {args.data} does not exist")
    for name in ("steps", "global_batch", "seq_len", "dim", "layers", "heads", "eval_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("tp", "ep", "pp"):
        size = getattr(args, name)
        if size < 1 or world % size:
            raise UsageError(f"--{name} {size} must be >= 1 and divide the {world} ranks")
    if args.alternate < 0:
        raise UsageError(f"--alternate must be >= 0 (rounds), got {args.alternate}")
    if args.alternate and (args.pp > 1 or args.gather != "param" or args.checkpoint):
        raise UsageError("--alternate times plain runs: use it without --pp, --gather fp8 and "
                         "--checkpoint")  # fmt: skip
    if args.pp > 1 and (args.tp > 1 or args.ep > 1):
        raise UsageError("--pp in this example runs without --tp and --ep")
    if args.pp > args.layers:
        raise UsageError(f"--pp {args.pp} needs at least as many --layers, got {args.layers}")
    if args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.tp > 1 and (args.moe or args.ep > 1):
        raise UsageError("--tp shards dense blocks in this example: use it without --moe/--ep")
    if args.ep > 1 and (not args.moe or args.moe % args.ep):
        raise UsageError(f"--ep {args.ep} needs --moe N with N a multiple of {args.ep}")
    if args.heads % args.tp:
        raise UsageError(f"--heads {args.heads} must be a multiple of --tp {args.tp}")
    # The tensor-parallel ranks (or pipeline stages) of a replica share its rows.
    replicas = world // args.tp // args.pp
    if args.global_batch % replicas:
        raise UsageError(
            f"--global-batch {args.global_batch} does not split over {replicas} data-parallel "
            f"replicas: use a multiple of {replicas} (or fewer ranks)"
        )
    if args.pp > 1 and (args.global_batch // replicas) % args.microbatches:
        raise UsageError(
            f"--global-batch {args.global_batch} gives {args.global_batch // replicas} rows per "
            f"replica, which --microbatches {args.microbatches} does not divide"
        )
    if args.dim % args.heads:
        raise UsageError(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    _check_checkpoints(args)
    if args.gather == "fp8" and args.engine == "fsdp2":
        raise UsageError(
            "--gather fp8 needs shards of whole 32-row blocks, which FSDP2's Shard(0) does "
            "not give: use --engine ours"
        )
    if args.optimizer == "adamw8bit" and args.engine == "fsdp2":
        raise UsageError(
            "--optimizer adamw8bit needs shards cut between 32-row blocks, which FSDP2's "
            "Shard(0) does not give: use --engine ours"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device on this machine")
    text = Text(args.data)
    text.batch("val", 0, 0, 1, args.seq_len)  # the text is long enough
    args.resume_from = _checkpoint_to_resume(args, len(text.chars))


def _check_checkpoints(args: argparse.Namespace) -> None:
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if args.checkpoint is not None and args.checkpoint.exists() and not args.checkpoint.is_dir():
        raise UsageError(f"--checkpoint {args.checkpoint} is a file; give a folder")
    if args.checkpoint_every and args.checkpoint is None:
        raise UsageError("--checkpoint-every needs --checkpoint FOLDER")
    if args.resume is not None and not args.resume.is_dir():
        raise UsageError(f"--resume {args.resume}: no checkpoint there (not a folder)")


def _checkpoint_to_resume(args: argparse.Namespace, vocab: int) -> Found | None:
    """--resume's checkpoint, else --checkpoint's newest; refused here if it cannot resume."""
    try:
        if args.resume is not None:
            found = find(args.resume)
            if found is None:
                raise UsageError(f"--resume {args.resume}: no checkpoint there (no meta.json)")
        elif args.checkpoint is not None:
            found = newest(args.checkpoint)
        else:
            return None
        if found is not None:
            check_resumable(found, run_settings(args, vocab, args.data), args.steps)
        return found
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None


# -- data ---------------------------------------------------------------------------------------


class Text:
    """Character-level tokens of a text file, the last 10% held out for validation."""

    def __init__(self, path: pathlib.Path) -> None:
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(tokens))
        self.train, self.val = tokens[:split], tokens[split:]

    def batch(self, split: str, seed: int, step: int, size: int, seq: int) -> torch.Tensor:
        """The global batch of a step: `size` sequences of seq + 1 tokens (same on every rank)."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq + 1:
            raise UsageError(f"--seq-len {seq} is longer than the {split} split ({len(data)})")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(data) - seq - 1, (size,), generator=gen)
        return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])

    def unigram_entropy(self) -> float:
        """Entropy (nats per character) of the training split's character frequencies."""
        counts = torch.bincount(self.train, minlength=len(self.chars)).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text."""
        return "".join(self.chars[i] for i in ids)
