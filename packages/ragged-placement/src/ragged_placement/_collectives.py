"""The collectives behind RaggedShard redistribution, with exact communication volume.

All functions work on one mesh axis (one process group of m ranks, this rank r) and on flat
pieces: rank j's piece is the range ranges[j] of the flattened tensor (or local block).

What each path sends (N = elements of the tensor, n_j = elements of rank j's piece):
- `gather_pieces` (RaggedShard -> Replicate): with equal pieces one all-gather into the
  output; otherwise one broadcast per non-empty piece, from its owner, into the output in
  place. Either way every rank receives exactly N - n_r elements, the ones it lacks. Gloo has
  no uneven list all_gather, and padding every piece to the largest would send up to
  m * max(n_j) elements; broadcasts need neither padding nor staging copies.
- `exchange_pieces` (RaggedShard -> RaggedShard, Shard(0) <-> RaggedShard): one
  all_to_all_single with uneven splits; rank r sends rank j exactly the overlap of its old
  piece with j's new piece, and nothing crosses the wire for the part it keeps. Input and
  output are the pieces themselves (the overlaps are consecutive in rank order), no staging.
  A one-hot target (Muon gathering a matrix to its owner) moves data only to the owner.
- `reduce_scatter_pieces` (Partial -> RaggedShard): one list reduce_scatter with uneven
  sizes over views of the input: a reduce-scatter's volume, not an all-reduce's.
- Replicate -> RaggedShard sends nothing: each rank slices its own range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ragged_placement._compat import all_gather_single, async_all_gather, async_all_to_all

Ranges = Sequence[tuple[int, int]]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def gather_pieces(
    local: torch.Tensor,
    ranges: Ranges,
    group: dist.ProcessGroup,
    numel: int,
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Every rank's piece, assembled into a new flat tensor of `numel` elements.

    With `async_op` and equal pieces the result completes lazily (waits on first use);
    uneven pieces are gathered before returning.
    """
    rank = dist.get_rank(group)
    out = torch.empty(numel, dtype=local.dtype, device=local.device)
    if group.size() > 1 and len({hi - lo for lo, hi in ranges}) == 1:
        # Equal pieces: one all-gather straight into the output, still exact and copy-free.
        if async_op:
            return async_all_gather(local.reshape(-1).contiguous(), group)
        all_gather_single(out, local.reshape(-1).contiguous(), group=group)
        return out
    start, end = ranges[rank]
    out[start:end].copy_(local.reshape(-1))
    if group.size() == 1:
        return out
    works = []
    for src, (lo, hi) in enumerate(ranges):
        if hi > lo:
            works.append(dist.broadcast(out[lo:hi], group_src=src, group=group, async_op=True))
    for work in works:
        if work is not None:
            work.wait()
    return out


def exchange_pieces(
    local: torch.Tensor,
    old: Ranges,
    new: Ranges,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Moves from pieces `old` to pieces `new` with one uneven all-to-all.

    With `async_op` the result completes lazily (waits on first use).
    """
    if group.size() == 1:
        return local.reshape(-1)
    rank = dist.get_rank(group)
    send = [_overlap(old[rank], piece) for piece in new]
    recv = [_overlap(piece, new[rank]) for piece in old]
    if async_op:
        return async_all_to_all(local.reshape(-1).contiguous(), recv, send, group)
    out = torch.empty(new[rank][1] - new[rank][0], dtype=local.dtype, device=local.device)
    dist.all_to_all_single(
        out,
        local.reshape(-1).contiguous(),
        output_split_sizes=recv,
        input_split_sizes=send,
        group=group,
    )
    return out


def reduce_scatter_pieces(
    full: torch.Tensor, ranges: Ranges, group: dist.ProcessGroup, reduce_op: str
) -> torch.Tensor:
    """Reduces the ranks' full flat tensors and leaves each rank only its own piece."""
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(
            f"cannot reduce-scatter Partial({reduce_op!r}); valid: {sorted(_REDUCE_OPS)}"
        )
    flat = full.reshape(-1).contiguous()
    if group.size() == 1:
        return flat.clone()
    rank = dist.get_rank(group)
    inputs = [flat[lo:hi] for lo, hi in ranges]
    out = torch.empty(ranges[rank][1] - ranges[rank][0], dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter(out, inputs, op=_REDUCE_OPS[reduce_op], group=group)
    return out
