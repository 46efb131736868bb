"""What every path of AdamW8bit's blockwise update takes: one piece's tensors and the tables.

The same six tensors go through the eager, compiled and C++ paths, in one order: a record
keeps that order in one place. It is a NamedTuple (immutable, like a frozen dataclass) so that
`update_blocks(*piece, ...)` passes plain tensors to torch.compile's graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The code maps and their lookups: (signed map, unsigned map, signed lookup, unsigned lookup).
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Piece8bit(NamedTuple):
    """One 2-D piece of a parameter and its 8-bit AdamW state, all updated in place.

    Attributes:
        param: (rows, cols), any float dtype, contiguous.
        grad: Its gradient, same shape.
        exp_avg: uint8 codes of the first moment (signed map), same shape.
        exp_avg_scale: float32 scale per block, (ceil(rows / block_rows), ceil(cols /
            block_cols)) elements.
        exp_avg_sq: uint8 codes of the second moment (unsigned map).
        exp_avg_sq_scale: Its scales.

    Example:
        >>> piece = Piece8bit(*(torch.zeros(2, 3),) * 2, *(torch.zeros(2, 3, dtype=torch.uint8),
        ...                   torch.zeros(1, 1)) * 2)
        >>> piece.exp_avg.dtype
        torch.uint8
    """

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_scale: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_sq_scale: torch.Tensor
