"""Block-wise 8-bit quantization: error bounds, edge blocks, block locality (anchors 10-12)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_optimizers import dequantize, dynamic_map, quantize

# Half the largest gap between neighbouring map values (times the block absmax): the top
# decade splits [0.1, 1] into 64 (signed) or 128 (unsigned) steps. The signed map's -absmax
# rounds to -(1 - 0.9 / 128): the same bound.
HALF_GAP = {True: 0.9 / 128, False: 0.9 / 256}


def test_maps() -> None:
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    assert signed.numel() == unsigned.numel() == 256
    assert torch.all(signed[1:] > signed[:-1]) and torch.all(unsigned[1:] > unsigned[:-1])
    assert signed[-1] == 1.0 and unsigned[-1] == 1.0 and unsigned[0] == 0.0
    assert (signed < 0).sum() == 127 and (signed == 0).sum() == 1
    assert abs(signed[0].item() + 0.99297) < 1e-5  # no -1.0
    for s in (True, False):
        gap = (dynamic_map(s)[1:] - dynamic_map(s)[:-1]).max().item() / 2
        assert abs(gap - HALF_GAP[s]) < 1e-6, gap


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(64, 64), (70, 45), (1, 33), (33, 1)])
def test_error_bound_and_exact_points(signed, shape) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = x if signed else x.square()
    codes, scales = quantize(x, (32, 32), signed=signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    back = dequantize(codes, scales, (32, 32), signed=signed)
    scale_per_element = scales.repeat_interleave(32, 0)[: shape[0]].repeat_interleave(32, 1)
    scale_per_element = scale_per_element[:, : shape[1]]
    assert torch.all((back - x).abs() <= HALF_GAP[signed] * scale_per_element * (1 + 1e-5))
    if signed:
        assert torch.all(torch.sign(back) * torch.sign(x) >= 0)  # a sign never flips
    # Each block's positive absmax element is exact; partial edge blocks scale over real
    # elements only (padding never raises a scale).
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = x[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]
            assert scales[i, j] == block.abs().max()
            if block.max() == scales[i, j]:
                k = block.argmax()
                got = back[32 * i : 32 * i + 32, 32 * j : 32 * j + 32].reshape(-1)[k]
                assert got == block.max()


def test_negative_absmax_zero_blocks_and_tiny_values() -> None:
    x = torch.zeros(64, 32)
    x[0, 0], x[1, 1] = -2.0, 1.0  # block 0: absmax is negative
    x[32:, :] = 0.0  # block 1: all zero
    codes, scales = quantize(x, (32, 32), signed=True)
    back = dequantize(codes, scales, (32, 32), signed=True)
    assert torch.equal(scales, torch.tensor([[2.0], [0.0]]))
    assert abs(back[0, 0].item() + 0.99297 * 2) < 1e-4  # -1.0 is not in the map
    assert not back.isnan().any() and not back[32:].any()
    tiny = torch.full((32, 32), 1e-30)
    tiny[0, 0] = 1.0
    back = dequantize(*quantize(tiny, (32, 32), signed=False), (32, 32), signed=False)
    assert back[0, 0] == 1.0 and not back.reshape(-1)[1:].any()  # below 1.6e-7 x absmax: 0


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_map_value(signed) -> None:
    # Against the definition: the number of midpoints between map values below x (ties go
    # down), on every midpoint and its float neighbours, every 17-bit bin's edges (where the
    # code lookup changes entry) and random values of all magnitudes.
    values = dynamic_map(signed)
    mids = (values[:-1] + values[1:]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    edges = (torch.arange(1 << 16, dtype=torch.int32) << 15).view(torch.float32)
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.exp2(-30 * torch.rand(200_000, generator=gen))
    signs = torch.randint(0, 2, (200_000,), generator=gen) * 2 - 1
    x = torch.cat(
        [
            mids,
            mids.nextafter(up),
            mids.nextafter(down),
            edges,
            edges.nextafter(down),
            magnitudes * signs,
            torch.tensor([0.0, -0.0, 1e-45, -1e-45]),
        ]
    )
    x = x[(x.abs() <= 1) & (x >= (-1 if signed else 0))]
    x = torch.cat([torch.tensor([1.0]), x]).view(1, -1)  # absmax 1: codes of x itself
    codes, scales = quantize(x, (1, x.shape[1]), signed=signed)
    assert scales.item() == 1.0
    expected = torch.bucketize(x, mids)  # counts midpoints < x
    assert torch.equal(codes.long(), expected)


def test_codes_are_monotone_in_the_value() -> None:
    x = torch.linspace(-1, 1, 4096).view(1, -1)
    codes, _ = quantize(x, (1, 4096), signed=True)
    assert torch.all(codes[0, 1:].int() >= codes[0, :-1].int())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 130),
    cols=st.integers(1, 70),
    cut=st.integers(0, 5),
    signed=st.booleans(),
)
def test_block_row_aligned_pieces_quantize_to_slices(rows, cols, cut, signed) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 100 + cols))
    codes, scales = quantize(x, (32, 32), signed=signed)
    lo = min(32 * cut, rows)
    pieces = ((slice(0, lo), slice(0, -(-lo // 32))), (slice(lo, rows), slice(lo // 32, None)))
    for piece, grid in pieces:
        if x[piece].shape[0]:
            piece_codes, piece_scales = quantize(x[piece], (32, 32), signed=signed)
            assert torch.equal(piece_scales, scales[grid])
            assert torch.equal(piece_codes, codes[piece])


def test_bad_input() -> None:
    codes, scales = quantize(torch.randn(40, 40), (32, 32), signed=True)
    with pytest.raises(ValueError, match="2-D uint8 codes"):
        dequantize(codes.float(), scales, (32, 32), signed=True)
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequantize(codes, scales[:1], (32, 32), signed=True)
    with pytest.raises(ValueError, match="2-D tensor"):
        quantize(torch.zeros(4), (32, 32), signed=True)
