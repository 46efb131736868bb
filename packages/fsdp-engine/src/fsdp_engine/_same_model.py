"""At lazy init: did every rank build the same model? One small collective per root.

Ranks that build different shapes (a config read differently, a rank-dependent branch) would
otherwise meet in a gather of different sizes: gloo aborts the process ("Is there a
distributed collective mismatch?") and NCCL hangs or reads garbage, with no word of which
tensor. Here each rank hashes the (name, global shape, dtype) of every parameter the root
manages and the ranks of the root's mesh compare the hashes, one all-gather of one integer
per mesh axis. Only when they differ are the lists themselves gathered, to name the first
tensor that differs and both shapes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_engine._compat import all_gather_single
from fsdp_engine._group import ParamGroup

Entry = tuple[str, tuple[int, ...], str]  # name, global shape, dtype


def check_groups_agree(
    root_modules: Sequence[nn.Module], groups: Sequence[tuple[nn.Module, ParamGroup]]
) -> None:
    """The root's check: its groups' parameters, named from the root, over its first mesh.

    Args:
        root_modules: The root's module(s), whose `named_modules()` name the groups.
        groups: Each group under the root with its (first) module.
    """
    held = [(module, group) for module, group in groups if group.buffers]
    if not held:
        return
    names = {id(m): n for root in root_modules for n, m in root.named_modules()}
    entries = []
    for module, group in held:
        prefix = names.get(id(module), group.label)
        for p in group.params:
            name = f"{prefix}.{p.name}" if prefix else p.name
            entries.append((name, tuple(p.sharded.shape), str(p.sharded.dtype)))
    first = held[0][1].buffers[0]
    if first.device.type == "meta":  # not materialized: forward refuses it anyway
        return
    axes = [first.shard_axis]
    if first.replicate_axis is not None:
        axes.append(first.replicate_axis)
    check_same_model(entries, first.mesh, axes, first.device)


def check_same_model(
    entries: Sequence[Entry], mesh: DeviceMesh, axes: Sequence[int], device: torch.device
) -> None:
    """Raises on every rank if the ranks of `mesh`'s `axes` hold different `entries`.

    Raises:
        ValueError: Naming the first tensor that differs (or is missing) and both shapes.

    Example (one rank: nothing to compare):
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> check_same_model([("w", (4, 2), "torch.float32")], mesh, [0], torch.device("cpu"))
    """
    digest = hashlib.sha256(repr(list(entries)).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=device)
    for axis in axes:
        group = mesh.get_group(axis)
        size = dist.get_world_size(group)
        if size == 1:
            continue
        gathered = torch.empty(size, dtype=torch.int64, device=device)
        all_gather_single(gathered, mine, group=group)
        if bool((gathered == mine).all()):
            continue
        everyone: list[list[Entry] | None] = [None] * size
        dist.all_gather_object(everyone, list(entries), group=group)
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(_first_difference(everyone, ranks))


def _first_difference(lists: Sequence[list[Entry] | None], ranks: Sequence[int]) -> str:
    """The first tensor whose name, shape or dtype differs between two ranks, named."""
    first = lists[0] or []
    for rank, other in zip(ranks[1:], lists[1:], strict=True):
        other = other or []
        for index in range(max(len(first), len(other))):
            a = first[index] if index < len(first) else None
            b = other[index] if index < len(other) else None
            if a == b:
                continue
            what_a = f"{a[0]!r} of shape {a[1]} ({a[2]})" if a else "nothing"
            what_b = f"{b[0]!r} of shape {b[1]} ({b[2]})" if b else "nothing"
            return (
                f"fully_shard: the ranks built different models: parameter {index} is "
                f"{what_a} on rank {ranks[0]} but {what_b} on rank {rank}; every rank must "
                f"build the same model before its first forward"
            )
    return "fully_shard: the ranks built different models (their parameter lists differ)"
