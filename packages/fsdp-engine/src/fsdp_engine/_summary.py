"""What sharding costs: per group, the elements held, the shard size and the padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_engine._state import states_under


@dataclass(frozen=True)
class GroupSummary:
    """One group's DBuffer (one per `fully_shard` call and dtype).

    Attributes:
        module: Class name of the module the group belongs to.
        dtype: The parameters' dtype.
        num_params: Parameters in the buffer.
        numel: Their elements.
        shard_numel: Elements each rank holds (S, padding included).
        num_ranks: Ranks the buffer is sharded over.
        padding: Elements of padding over all ranks: num_ranks * shard_numel - numel.
    """

    module: str
    dtype: torch.dtype
    num_params: int
    numel: int
    shard_numel: int
    num_ranks: int

    def __post_init__(self) -> None:
        if self.num_ranks * self.shard_numel < self.numel:
            raise ValueError(
                f"{self.num_ranks} shards of {self.shard_numel} cannot hold {self.numel} elements"
            )

    @property
    def padding(self) -> int:
        return self.num_ranks * self.shard_numel - self.numel

    @property
    def padding_bytes(self) -> int:
        return self.padding * self.dtype.itemsize


def sharding_summary(module: nn.Module) -> list[GroupSummary]:
    """One GroupSummary per DBuffer of every FSDP group in `module`'s subtree.

    Args:
        module: A module `fully_shard` was applied to (or one containing such modules).

    Returns:
        The groups in module order.

    Example:
        >>> groups = sharding_summary(fully_shard(model))
        >>> len(groups), sum(g.padding_bytes for g in groups)
        (1, 0)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"sharding_summary takes an nn.Module, got {type(module).__name__}")
    out: list[GroupSummary] = []
    for state in states_under([module]):
        if state.group is None:
            continue
        for buffer in state.group.buffers:
            out.append(
                GroupSummary(
                    module=state.group.label,
                    dtype=buffer.dtype,
                    num_params=len(buffer.names),
                    numel=sum(s.numel for s in buffer.layout.tensors),
                    shard_numel=buffer.shard_size,
                    num_ranks=buffer.layout.world_size,
                )
            )
    return out
