"""The main job's checkpoints: never lost, never mixed, never loaded into the wrong run.

Layout: `--checkpoint D` holds one folder per saved step, `D/step-000012/`, each a
torch.distributed.checkpoint (DCP) of the model and optimizer state plus `meta.json` (the
step, the run's model and training settings, and each file's size and SHA-256). A save
writes everything into `D/.step-000012.tmp/` and rank 0 renames that folder into place after
every rank's files and `meta.json` are on disk (fsynced): the rename is the commit. A kill at
any moment therefore leaves either the new complete checkpoint or a `.tmp` folder that
nothing loads (the next save removes it), and the previous checkpoints untouched. Only the
newest `keep` complete checkpoints stay.

Resuming (`--resume PATH`, or `--checkpoint D` when D already holds a checkpoint: how a
torchrun restart continues where it stopped) reads the newest complete checkpoint, refuses
one saved with other model or training settings (naming the setting and both values), and
checks every file's digest before loading (a changed byte is an error naming the file).
The world size and engine may differ: DCP reshards, and both engines load each other's.

For tests of recovery, `RAGGED_FSDP_FAULT=kill-in-save:STEP:RANK` SIGKILLs that rank after it
wrote its part of step STEP's checkpoint and before the commit; `kill-at-step:STEP:RANK`
before that step's forward. Both act only in a first attempt (torchrun's
TORCHELASTIC_RESTART_COUNT unset or 0), so a restart runs clean.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FORMAT = 1
META = "meta.json"
_PREFIX = "step-"
# Settings a checkpoint must share with the run that resumes it: its tensors' shapes, the
# optimizer's state, the data and the step's arithmetic. The world size, the engine and the
# parallel layout may change (DCP reshards); so may --steps and what is measured or printed.
MATCHING = (
    "dim",
    "layers",
    "heads",
    "moe",
    "vocab",
    "optimizer",
    "lr",
    "seed",
    "global_batch",
    "seq_len",
    "mixed_precision",
    "gather",
    "data_sha256",
)


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message names the file or the setting."""


@dataclasses.dataclass(frozen=True)
class Found:
    """A complete checkpoint: its folder, step and meta.json."""

    path: pathlib.Path
    step: int
    meta: dict[str, Any]


def run_settings(args: Any, vocab: int, data: pathlib.Path) -> dict[str, Any]:
    """The settings of `MATCHING` for this run (recorded in every checkpoint's meta.json)."""
    settings = {name: getattr(args, name) for name in MATCHING if hasattr(args, name)}
    settings["vocab"] = vocab
    settings["data_sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    return settings


def step_folder(root: pathlib.Path, step: int) -> pathlib.Path:
    """Where the checkpoint of `step` lives under `root`."""
    return root / f"{_PREFIX}{step:06d}"


def read_meta(folder: pathlib.Path) -> dict[str, Any]:
    """A checkpoint folder's meta.json, checked for the fields this module writes."""
    path = folder / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint meta.json ({exc})") from None
    fields = {"format": int, "step": int, "settings": dict, "files": dict}
    for name, kind in fields.items():
        if not isinstance(meta, dict) or not isinstance(meta.get(name), kind):
            raise CheckpointError(f"{path}: no {name!r} ({kind.__name__}) in it")
    if meta["format"] != FORMAT:
        raise CheckpointError(f"{path}: format {meta['format']}, this script reads {FORMAT}")
    return dict(meta)


def newest(root: pathlib.Path) -> Found | None:
    """The newest complete checkpoint under `root` (a step folder with meta.json), or None."""
    if not root.is_dir():
        return None
    steps = []
    for folder in root.iterdir():
        digits = folder.name.removeprefix(_PREFIX)
        if folder.name.startswith(_PREFIX) and digits.isdigit() and (folder / META).is_file():
            steps.append((int(digits), folder))
    if not steps:
        return None
    step, folder = max(steps)
    meta = read_meta(folder)
    if meta["step"] != step:
        raise CheckpointError(f"{folder / META}: step {meta['step']} in a folder of step {step}")
    return Found(folder, step, meta)


def find(path: pathlib.Path) -> Found | None:
    """The checkpoint at `path`: that folder if it holds meta.json, else the newest in it."""
    if (path / META).is_file():
        meta = read_meta(path)
        return Found(path, meta["step"], meta)
    return newest(path)


def check_resumable(found: Found, settings: dict[str, Any], steps: int) -> None:
    """Refuses a checkpoint of other settings, or one at or past the run's last step."""
    saved = found.meta["settings"]
    for name in MATCHING:
        if name in settings and saved.get(name) != settings[name]:
            option = "the data file" if name == "data_sha256" else f"--{name.replace('_', '-')}"
            raise CheckpointError(
                f"{found.path} was saved with {option} {saved.get(name)!r}, this run has "
                f"{settings[name]!r}; resume with the settings it was saved with"
            )
    if found.step >= steps:
        raise CheckpointError(
            f"{found.path} is at step {found.step}, --steps {steps} leaves nothing to train: "
            f"give --steps above {found.step}"
        )


# -- saving -------------------------------------------------------------------------------------


def save(
    root: pathlib.Path,
    step: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    settings: dict[str, Any],
    keep: int,
) -> pathlib.Path:
    """Saves step `step` under `root` (every rank calls it); returns the checkpoint folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    final = step_folder(root, step)
    temporary = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f".{_PREFIX}*.tmp"):  # left by a save that was killed
            shutil.rmtree(stale)
        temporary.mkdir()
    dist.barrier()
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.state_dict_saver.save(state, checkpoint_id=str(temporary))
    _fault("kill-in-save", step)
    files = _digests(temporary, _my_files(temporary))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files)
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": dist.get_world_size(),
            "settings": settings,
            "files": {name: entry for part in gathered for name, entry in part.items()},
        }
        _write_synced(temporary / META, json.dumps(meta, indent=1))
        _sync_folder(temporary)
        if final.exists():  # the same step saved again (a run that resumed from before it)
            shutil.rmtree(final)
        os.rename(temporary, final)
        _sync_folder(root)
        _prune(root, keep)
    dist.barrier()
    return final


def _my_files(folder: pathlib.Path) -> list[str]:
    """This rank's share of the folder's files (rank 0 lists them for all)."""
    names: list[Any] = [sorted(p.name for p in folder.iterdir()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return list(names[0][dist.get_rank() :: dist.get_world_size()])


def _digests(folder: pathlib.Path, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        with open(folder / name, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        out[name] = {"bytes": (folder / name).stat().st_size, "sha256": digest}
    return out


def _write_synced(path: pathlib.Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(partial, path)


def _sync_folder(folder: pathlib.Path) -> None:
    """Makes the folder's entries (new files, renames) durable."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _prune(root: pathlib.Path, keep: int) -> None:
    """Removes all but the newest `keep` complete checkpoints."""
    complete = sorted(
        (p for p in root.iterdir() if p.name.startswith(_PREFIX)),
        key=lambda p: int(p.name.removeprefix(_PREFIX)) if p.name[len(_PREFIX) :].isdigit() else -1,
    )
    for folder in complete[:-keep]:
        shutil.rmtree(folder)


# -- loading ------------------------------------------------------------------------------------


def load(found: Found, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Checks every file's digest, then loads `found` into model and optimizer; its step.

    Every rank checks its share of the files; a mismatch anywhere is raised on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    expected: dict[str, dict[str, Any]] = found.meta["files"]
    names = sorted(expected)[dist.get_rank() :: dist.get_world_size()]
    problems = []
    for name in names:
        path = found.path / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif _digests(found.path, [name])[name] != expected[name]:
            problems.append(f"{path} differs from its digest in {found.path / META}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    found_problems = [p for part in gathered for p in part]
    if found_problems:
        raise CheckpointError(f"{found_problems[0]} (the checkpoint is damaged)")
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.state_dict_loader.load(state, checkpoint_id=str(found.path))  # in place
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    return found.step


# -- fault injection (tests of recovery) --------------------------------------------------------

FAULT = "RAGGED_FSDP_FAULT"


def _fault(where: str, step: int) -> None:
    """SIGKILLs this rank where `RAGGED_FSDP_FAULT` asks, in a first attempt only."""
    spec = os.environ.get(FAULT)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kind, at_step, at_rank = spec.split(":")
    if kind == where and int(at_step) == step and int(at_rank) == dist.get_rank():
        os.kill(os.getpid(), signal.SIGKILL)


def fault_before_step(step: int) -> None:
    """The `kill-at-step` fault point (train.py calls it before each step's forward)."""
    _fault("kill-at-step", step)
