"""The one-process reference of a block-scaled fp8 quantize-dequantize, written block by block.

What the fp8 gathers must equal bit for bit: each block's scale from its absmax, its codes,
and the dequantized values, computed here with one loop per block (no shared code with the
implementation, which works on whole regions of blocks at once).
"""

from __future__ import annotations

import torch


def reference_block_qdq(
    x: torch.Tensor, block: tuple[int, int], fmt: torch.dtype, out: torch.dtype
) -> torch.Tensor:
    """The quantize-dequantize of the whole tensor in one process, one block at a time."""
    matrix = x.reshape(-1, x.shape[-1]).float()
    top = torch.finfo(fmt).max
    result = torch.empty(matrix.shape, dtype=out)
    for r in range(0, matrix.shape[0], block[0]):
        for c in range(0, matrix.shape[1], block[1]):
            values = matrix[r : r + block[0], c : c + block[1]]
            amax = values.abs().max()
            scale = amax / top if amax > 0 else torch.tensor(1.0)
            codes = (values / scale).clamp(-top, top).to(fmt)
            result[r : r + block[0], c : c + block[1]] = (codes.float() * scale).to(out)
    return result.view(x.shape)
