"""Per-head Muon: an attention projection orthogonalized head by head, not as one matrix.

A query/key/value projection (H x d, D) holds H heads along its rows (dim 0); an output
projection (D, H x d) along its columns (dim 1). Per-head Muon (as Kimi K2 trains) runs
Newton-Schulz on each head's (d, D) or (D, d) block: one batched call over the H blocks of
every matrix of a unit. The owner holds whole matrices, so heads are split after the gather
and joined before the scatter: sharding and the exchange are the same as per matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

HEADS_DIMS = (0, 1)


def head_shape(shape: Sequence[int], num_heads: int | None, heads_dim: int) -> tuple[int, ...]:
    """What Newton-Schulz sees of a matrix or stack `shape` split into `num_heads` heads.

    Example:
        >>> head_shape((64, 32), 4, 0), head_shape((2, 32, 64), 4, 1)
        ((4, 16, 32), (8, 32, 16))
    """
    if num_heads is None:
        return tuple(shape)
    *batch, rows, cols = shape
    count = math.prod(batch) * num_heads
    if heads_dim == 0:
        return (count, rows // num_heads, cols)
    return (count, rows, cols // num_heads)


def split_heads(x: torch.Tensor, num_heads: int, heads_dim: int) -> torch.Tensor:
    """(..., rows, cols) -> (count x num_heads, head rows, head cols), heads in order.

    Example:
        >>> x = torch.arange(8.0).view(2, 4)
        >>> split_heads(x, 2, 1).tolist()  # columns 0-1, then 2-3
        [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]
    """
    rows, cols = x.shape[-2:]
    if heads_dim == 0:
        return x.reshape(-1, rows // num_heads, cols)
    blocks = x.reshape(-1, rows, num_heads, cols // num_heads).transpose(1, 2)
    return blocks.reshape(-1, rows, cols // num_heads)


def join_heads(
    heads: torch.Tensor, shape: Sequence[int], num_heads: int, heads_dim: int
) -> torch.Tensor:
    """The inverse of `split_heads` for a tensor of `shape`.

    Example:
        >>> x = torch.arange(8.0).view(2, 4)
        >>> torch.equal(join_heads(split_heads(x, 2, 1), x.shape, 2, 1), x)
        True
    """
    rows, cols = shape[-2:]
    if heads_dim == 0:
        return heads.reshape(shape)
    blocks = heads.reshape(-1, num_heads, rows, cols // num_heads).transpose(1, 2)
    return blocks.reshape(shape)


def check_heads(name: str, shape: Sequence[int], num_heads: object, heads_dim: object) -> None:
    """Raises a ValueError naming the parameter unless its heads split it evenly.

    Example:
        >>> check_heads("wq", (64, 32), 4, 0)
        >>> check_heads("wo", (32, 60), 8, 1)
        Traceback (most recent call last):
        ...
        ValueError: wo of shape (32, 60): dim 1 (60) does not split into num_heads=8 heads
    """
    if heads_dim not in HEADS_DIMS or isinstance(heads_dim, bool):
        raise ValueError(
            f"heads_dim must be 0 (heads along rows: q, k, v) or 1 (along columns: the "
            f"output projection), got {heads_dim!r}"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be None or an int >= 1, got {num_heads!r}")
    if len(shape) not in (2, 3):
        raise ValueError(
            f"{name} of shape {tuple(shape)}: per-head Muon splits 2-D matrices (or 3-D "
            f"stacks of them); put it in a group without num_heads"
        )
    size = shape[len(shape) - 2 + int(heads_dim)]
    if size % num_heads:
        raise ValueError(
            f"{name} of shape {tuple(shape)}: dim {len(shape) - 2 + int(heads_dim)} ({size}) "
            f"does not split into num_heads={num_heads} heads"
        )
