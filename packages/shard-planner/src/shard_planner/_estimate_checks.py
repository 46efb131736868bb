"""`estimate`'s input checks: what each argument may be, refused by name before any work."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shard_planner._activations import ActivationModel
from shard_planner._compute import ComputeModel
from shard_planner._presets import GroupSpec
from shard_planner._spec import TensorSpec, check_count

OPTIMIZERS = ("adamw", "adamw8bit", "muon", "sgd")
QUANT_BLOCK = 32  # AdamW8bit's block: 32 x 32
MIN_8BIT_NUMEL = 4096


def check_bytes(name: str, value: object) -> int:
    count = check_count(name, value, 1)
    if count not in (1, 2, 4, 8):
        raise ValueError(f"{name} must be 1, 2, 4 or 8 (bytes per element), got {count}")
    return count


def check_expert_parallel(value: object, shard_size: int, compute: ComputeModel | None) -> int:
    ep = check_count("expert_parallel", value, 1)
    if shard_size % ep:
        raise ValueError(f"expert_parallel {ep} must divide shard_size {shard_size}")
    if ep > 1 and (compute is None or None in (compute.top_k, compute.hidden_size)):
        raise ValueError(
            f"expert_parallel={ep} sends tokens to their experts: give compute=ComputeModel("
            f"tokens_per_rank=..., top_k=..., hidden_size=...) to count the all-to-alls"
        )
    return ep


def check_element_bytes(
    param_bytes: object, grad_bytes: object, compute_bytes: object, align_bytes: int
) -> tuple[int, int, int]:
    """(parameter, gradient, gathered) bytes per element, each 1, 2, 4 or 8."""
    param = check_bytes("param_bytes", param_bytes)
    grad = check_bytes("grad_bytes", grad_bytes)
    gathered = param if compute_bytes is None else check_bytes("compute_bytes", compute_bytes)
    if align_bytes % param:
        raise ValueError(f"align_bytes {align_bytes} is not a multiple of param_bytes")
    return param, grad, gathered


def check_models(compute: object, activations: object, reshard_after_forward: object) -> None:
    if compute is not None and not isinstance(compute, ComputeModel):
        raise TypeError(f"compute must be a ComputeModel, got {type(compute).__name__}")
    if activations is not None and not isinstance(activations, ActivationModel):
        raise TypeError(f"activations must be an ActivationModel, got {activations!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")


def check_optimizer(optimizer: str, block_rows: int) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if optimizer == "adamw8bit" and block_rows % QUANT_BLOCK:
        raise ValueError(
            f"optimizer 'adamw8bit' needs shards cut between {QUANT_BLOCK}-row blocks: "
            f"block_rows must be a multiple of {QUANT_BLOCK}, got {block_rows}"
        )


def check_links(**links: object) -> None:
    """Finite bandwidths > 0 and finite latencies >= 0 (user input: checked for what came)."""
    for name, value in links.items():
        low = 0 if name.endswith("_us") else None
        ok = isinstance(value, int | float) and finite(value)
        if not ok or (value <= 0 if low is None else value < low):  # type: ignore[operator]
            bound = ">= 0" if low is not None else "> 0"
            raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class BlockTooLargeError(ValueError):
    """A group has fewer unsplittable blocks than ranks: some would hold only padding."""


def check_blocks_fit(group: GroupSpec, specs: Sequence[TensorSpec], shard_size: int) -> None:
    """At least one block per rank: with fewer, a rank's shard is all padding."""
    num_blocks = sum(-(-s.numel // s.atom) for s in specs if s.numel)
    if num_blocks < shard_size:
        index = max(range(len(specs)), key=lambda i: specs[i].atom)
        name, atom = group.entries[index].name, specs[index].atom  # specs may be a twin's
        raise BlockTooLargeError(
            f"group {group.name!r} has {num_blocks:,} blocks in all (largest: "
            f"{name!r}, {atom:,} elements), fewer than W={shard_size} ranks: "
            f"no shard boundary may cut a block, so {shard_size - num_blocks:,} ranks would "
            f"hold only padding; use smaller block_rows or W <= {num_blocks} (or "
            f"allow_idle_ranks=True)"
        )


def check_groups(groups: Sequence[GroupSpec]) -> tuple[GroupSpec, ...]:
    """A non-empty sequence of GroupSpecs, each with at least one tensor."""
    given: object = groups  # user input: check what came
    if isinstance(given, GroupSpec):
        raise TypeError("groups must be a sequence of GroupSpecs, got one GroupSpec: use [group]")
    found: tuple[object, ...] = tuple(groups)
    if not found:
        raise ValueError("groups is empty: give the model's FSDP groups")
    checked = []
    for group in found:
        if not isinstance(group, GroupSpec):
            raise TypeError(
                f"groups must be GroupSpecs (e.g. load_preset(name).groups); got "
                f"{type(group).__name__} {group!r:.80}"
            )
        if not group.entries:
            raise ValueError(f"group {group.name!r} has no tensors")
        checked.append(group)
    return tuple(checked)
