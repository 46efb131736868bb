"""Muon beside tensor parallelism: each matrix orthogonalized on one tp rank, not on all.

A tensor-parallel matrix is split evenly over the tp axis (`Shard(d)`); the dp owner of its
pieces is the same dp rank on every tp rank (plans depend on shapes alone), so those tp
ranks hold its blocks. Rather than each gathering the whole and repeating the same
Newton-Schulz, one of them (the owner plan's slots are dp owner x tp rank, so the work
spreads evenly over both axes) gathers the blocks, orthogonalizes, and scatters each rank
its block: the same bytes as the all-gather each way (in bfloat16, which Newton-Schulz
computes in), 1/tp of the FLOPs per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ragged_optimizers._layout import ParamLayout


def orthogonalize_on_one_rank(
    layout: ParamLayout,
    split: tuple[int, int],
    blocks: list[torch.Tensor],
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    owner: int,
) -> list[torch.Tensor]:
    """This rank's flat blocks of `orthogonalize` applied to the whole matrices.

    Args:
        layout: The unit's layout (its blocks' shape and the mesh).
        split: (mesh axis, tensor dim) of the tensor-parallel split.
        blocks: This rank's flat block of each matrix of the unit.
        orthogonalize: (count, full numel) whole flat matrices -> the same, orthogonalized.
        owner: The tp rank that gathers, orthogonalizes and scatters (the plan's).
    """
    assert layout.mesh is not None
    axis, dim = split
    group = layout.mesh.get_group(axis)
    size, me = layout.mesh.size(axis), layout.mesh.get_local_rank(axis)
    owner_global = dist.get_global_rank(group, owner)
    # Newton-Schulz casts its input to bfloat16 first and returns bfloat16: moving the blocks
    # in bfloat16 both ways gives the same result for half the bytes.
    stacked = torch.stack([block.view(layout.shape) for block in blocks]).to(torch.bfloat16)
    gathered = [torch.empty_like(stacked) for _ in range(size)] if me == owner else None
    dist.gather(stacked, gathered, dst=owner_global, group=group)
    pieces = None
    if gathered is not None:
        whole = torch.cat(gathered, dim=dim + 1)  # dim 0 is the unit's matrices
        out = orthogonalize(whole.reshape(len(blocks), -1)).view(whole.shape)
        pieces = [p.to(torch.bfloat16).contiguous() for p in out.chunk(size, dim=dim + 1)]
    mine = torch.empty_like(stacked)
    dist.scatter(mine, pieces, src=owner_global, group=group)
    return list(mine.reshape(len(blocks), -1).unbind())
