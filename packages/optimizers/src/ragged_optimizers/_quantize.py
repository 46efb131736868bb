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


# Nearest-value search without a binary search: a float32 is binned by its top 17 bits (sign,
# exponent and 8 mantissa bits: bins 2^-8 of a power of two wide). The map's values are at
# least 0.7% apart, so a bin holds at most one midpoint between neighbouring values. One int32
# per bin holds the code at the bin's low end (high 16 bits) and where in the bin that midpoint
# lies (low 16 bits), as a threshold on the element's low 15 bits, flipped for negative
# numbers so that within a bin a larger key is a larger value: one table read per element.
_KEY_SHIFT = 15
_KEY_MASK = (1 << 17) - 1
_LOW_MASK = (1 << _KEY_SHIFT) - 1


@functools.cache
def _code_table(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(code at the low end of each bin, uint8; midpoints padded with +inf, float32)."""
    midpoints = (dynamic_map(signed)[:-1] + dynamic_map(signed)[1:]) / 2
    lows = (torch.arange(1 << 16, dtype=torch.int32) << _KEY_SHIFT).view(torch.float32)
    highs = torch.cat([lows[1:], torch.tensor([float("inf")])])
    # Code = number of midpoints below x. Positive bin [lo, hi): count those < lo; negative
    # bin (-hi, -lo]: count those <= -hi.
    positive = torch.bucketize(lows, midpoints)
    negative = torch.bucketize(-highs, midpoints, right=True)
    finite = highs < float("inf")  # past the largest float: inf and NaN patterns
    spans = torch.bucketize(highs, midpoints) - positive
    spans = torch.maximum(spans, torch.bucketize(-lows, midpoints, right=True) - negative)
    assert int(spans[finite].max()) <= 1, "a bin holds two midpoints: the map is too fine"
    table = torch.cat([positive, negative]).to(torch.uint8)
    return table, torch.cat([midpoints, torch.tensor([float("inf")])])


def _low_key(bits: torch.Tensor) -> torch.Tensor:
    """The low 15 bits of float32 bit patterns, flipped for negative numbers."""
    low = bits & _LOW_MASK
    return torch.where(bits < 0, low ^ _LOW_MASK, low)


@functools.cache
def code_lookup(signed: bool) -> torch.Tensor:
    """One int32 per 17-bit bin: (code at the bin's low end << 16) | threshold.

    An element x of the bin gets code + 1 when its `_low_key` is at least the threshold, that
    is when x lies above the bin's midpoint; 2**15 (never reached) when the bin holds none.
    """
    table, midpoints = _code_table(signed)
    base = table.int()
    midpoint_bits = midpoints[base.long()].view(torch.int32)
    bins = torch.arange(1 << 17, dtype=torch.int32)
    in_bin = ((midpoint_bits >> _KEY_SHIFT) & _KEY_MASK) == bins
    threshold = torch.where(in_bin, _low_key(midpoint_bits) + 1, 1 << _KEY_SHIFT)
    return (base << 16) | threshold


@functools.cache
def device_tables(device: torch.device, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(`dynamic_map(signed)`, `code_lookup(signed)`) on `device`, copied there once."""
    return dynamic_map(signed).to(device), code_lookup(signed).to(device)


def nearest_codes(x: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    """The code (uint8) of the map value nearest to each element of a float32 tensor.

    Ties go to the lower code. Plain tensor ops only, so that torch.compile fuses it.

    Args:
        x: Values in [-1, 1] (signed map) or [0, 1] (unsigned), any shape.
        lookup: `code_lookup(signed)` on x's device (`device_tables`).
    """
    bits = x.view(torch.int32)
    entry = lookup[(bits >> _KEY_SHIFT) & _KEY_MASK]
    above = (_low_key(bits) >= (entry & 0xFFFF)).int()
    return ((entry >> 16) + above).to(torch.uint8)


def blocked(x: torch.Tensor, block: tuple[int, int], fill: float = 0) -> torch.Tensor:
    """A (rows, cols) tensor as (row blocks, block_rows, col blocks, block_cols), padded."""
    rows, cols = x.shape
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    if pad_rows or pad_cols:
        x = pad(x, (0, pad_cols, 0, pad_rows), value=fill)
    return x.view(x.shape[0] // block[0], block[0], x.shape[1] // block[1], block[1])


def unblocked(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, br, c, bc = blocks.shape
    return blocks.reshape(r * br, c * bc)[:rows, :cols]


def block_absmax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest |x| of each block of a 2-D tensor: shape (ceil(rows/br), ceil(cols/bc)).

    Example:
        >>> block_absmax(torch.tensor([[1.0, -3.0, 2.0]]), (1, 2))
        tensor([[3., 2.]])
    """
    return blocked(x.abs(), block).amax(dim=(1, 3))


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
    normalized = blocked(x, block) / divisor[:, None, :, None]
    codes = nearest_codes(normalized, device_tables(x.device, signed)[1])
    return unblocked(codes, *x.shape).contiguous(), scales


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
    if codes.dtype != torch.uint8 or codes.ndim != 2:
        raise ValueError(
            f"dequantize takes 2-D uint8 codes, got {codes.dtype} of shape {tuple(codes.shape)}"
        )
    grid = (-(-codes.shape[0] // block[0]), -(-codes.shape[1] // block[1]))
    if tuple(scales.shape) != grid:
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not match codes of shape "
            f"{tuple(codes.shape)} in blocks of {block}: expected {grid}"
        )
    table = device_tables(codes.device, signed)[0]
    values = table.index_select(0, codes.reshape(-1).int()).view(codes.shape)
    blocks = blocked(values, block) * scales[:, None, :, None]
    return unblocked(blocks, *codes.shape).contiguous()
