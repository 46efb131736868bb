"""Block-wise 8-bit quantization of optimizer state in 2-D blocks.

A value x in a block with absmax s is stored as the index (uint8) of the map entry nearest to
x / s, and read back as map[index] * s. The maps are "dynamic": 256 sorted values in [-1, 1]
(signed, for Adam's first moment) or [0, 1] (unsigned, for the second), spaced linearly within
each of seven decades 1e-7..1, so that small values keep their relative precision. A block is
`block_rows` x `block_cols` elements of a 2-D tensor (partial at the bottom and right edges),
and its scale is the largest |x| among its real elements. A tensor whose rows are cut only at
multiples of `block_rows` therefore quantizes piece by piece to exactly the slices of the whole
tensor's codes and scales: no communication, and the same state on any number of ranks.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.functional import pad


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values a code can stand for (float32).

    Signed: 0, 1 and, per decade d = 0..6, 2**d midpoints of an even split of
    [0.1, 1] x 10**(d - 6) with both signs (127 negative values, none of them -1). Unsigned:
    0, 1 and 2**(d + 1) positive midpoints per decade.

    Example:
        >>> m = dynamic_map(signed=True)
        >>> m.numel(), m[0].item() > -1.0, m[-1].item(), (m == 0).sum().item()
        (256, True, 1.0, 1)
    """
    values = [0.0, 1.0]
    for decade in range(7):
        count = 2**decade if signed else 2 ** (decade + 1)
        scale = 10.0 ** (decade - 6)
        step = 0.9 / count
        means = [scale * (0.1 + step * (k + 0.5)) for k in range(count)]
        values += means
        if signed:
            values += [-v for v in means]
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _midpoints(signed: bool) -> torch.Tensor:
    table = dynamic_map(signed)
    return (table[:-1] + table[1:]) / 2


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A (rows, cols) tensor as (row blocks, block_rows, col blocks, block_cols), zero-padded."""
    rows, cols = x.shape
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    if pad_rows or pad_cols:
        x = pad(x, (0, pad_cols, 0, pad_rows))
    return x.view(x.shape[0] // block[0], block[0], x.shape[1] // block[1], block[1])


def _unblocked(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, br, c, bc = blocks.shape
    return blocks.reshape(r * br, c * bc)[:rows, :cols]


def block_absmax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest |x| of each block of a 2-D tensor: shape (ceil(rows/br), ceil(cols/bc)).

    Example:
        >>> block_absmax(torch.tensor([[1.0, -3.0, 2.0]]), (1, 2))
        tensor([[3., 2.]])
    """
    return _blocked(x.abs(), block).amax(dim=(1, 3))


def quantize(
    x: torch.Tensor, block: tuple[int, int], *, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, x's shape) and scales (float32, one per block) of a 2-D tensor.

    Args:
        x: A 2-D float tensor.
        block: (block_rows, block_cols).
        signed: Use the signed map (values of either sign) or the unsigned one (x >= 0).

    Returns:
        (codes, scales).

    Example:
        >>> codes, scales = quantize(torch.tensor([[0.5, -1.0], [0.0, 0.25]]), (2, 2), signed=True)
        >>> dequantize(codes, scales, (2, 2), signed=True)
        tensor([[ 0.5008, -0.9930],
                [ 0.0000,  0.2477]])
    """
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    x = x.float()
    scales = block_absmax(x, block)
    # An all-zero block keeps scale 0 and codes of 0.0; dividing by 1 avoids 0 / 0.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    normalized = _blocked(x, block) / divisor[:, None, :, None]
    codes = torch.bucketize(normalized, _midpoints(signed).to(x.device))
    return _unblocked(codes, *x.shape).to(torch.uint8), scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], *, signed: bool
) -> torch.Tensor:
    """The float32 values that `codes` and `scales` stand for.

    Args:
        codes: uint8 codes of a 2-D tensor.
        scales: One scale per block, as `quantize` returned them.
        block: (block_rows, block_cols).
        signed: The map the codes index.

    Returns:
        A float32 tensor of the codes' shape.

    Example:
        >>> dequantize(torch.tensor([[255]], dtype=torch.uint8), torch.tensor([[2.0]]), (1, 1),
        ...            signed=False)
        tensor([[2.]])
    """
    values = dynamic_map(signed).to(codes.device)[codes.long()]
    blocks = _blocked(values, block) * scales[:, None, :, None]
    return _unblocked(blocks, *codes.shape).contiguous()
