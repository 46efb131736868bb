"""Newton-Schulz against a float64 evaluation of the same polynomial chain (anchors item 1-2)."""

import pytest
import torch

from ragged_optimizers import newton_schulz, resolve_coefficients

SHAPES = [(32, 32), (64, 16), (16, 64), (1, 40), (40, 1), (3, 24, 8)]


def _float64_chain(g: torch.Tensor, steps, eps: float, norm_scale: float) -> torch.Tensor:
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) * norm_scale
    x = x / norm.clamp(min=eps)
    for a, b, c in steps:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


@pytest.mark.parametrize("shape", SHAPES)
# Measured worst cases over 5 seeds: 0.018 (Keller), 0.079 (Polar Express, whose first step
# has slope ~16 at singular value 1 and so amplifies bf16 rounding of a 1 x n input).
@pytest.mark.parametrize(("name", "tolerance"), [("keller", 0.03), ("polar_express", 0.1)])
def test_matches_float64_within_bf16_tolerance(shape, name, tolerance) -> None:
    steps, norm_scale = resolve_coefficients(name, 5)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = newton_schulz(g, steps, norm_scale=norm_scale).double()
    want = _float64_chain(g, steps, 1e-7, norm_scale)
    err = (got - want).abs().max().item()
    assert err < tolerance, err
    assert got.shape == g.shape


@pytest.mark.parametrize("shape", SHAPES)
def test_transpose_rule(shape) -> None:
    # Non-square: both run on the short side, so the rule is exact. Square: X X^T and X^T X
    # round differently, so only close.
    steps, _ = resolve_coefficients("keller", 5)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    a, b = newton_schulz(g.mT, steps), newton_schulz(g, steps).mT
    if shape[-1] != shape[-2]:
        assert torch.equal(a, b)
    else:
        assert (a.float() - b.float()).abs().max() < 0.03


def test_scale_invariance_and_zero_input() -> None:
    steps, _ = resolve_coefficients("keller", 5)
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(2))
    a, b = newton_schulz(g, steps).float(), newton_schulz(g * 1000.0, steps).float()
    assert (a - b).abs().max() < 0.05
    zero = newton_schulz(torch.zeros(8, 16), steps)
    assert torch.equal(zero, torch.zeros(8, 16, dtype=torch.bfloat16))
    stack = newton_schulz(torch.zeros(2, 8, 16), steps)
    assert not stack.isnan().any() and not stack.float().any()


@pytest.mark.parametrize(
    ("name", "low", "high"), [("keller", 0.68, 1.13), ("polar_express", 0.86, 1.14)]
)
def test_singular_values_land_in_the_expected_band(name, low, high) -> None:
    # Singular values spread over [1e-2, 1] of the largest: the band the coefficients target.
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    sigma = torch.logspace(-2, 0, 64, dtype=torch.float64)
    g = (u * sigma) @ v.T
    steps, norm_scale = resolve_coefficients(name, 5)
    # The input is divided by its Frobenius norm (about sqrt(sum sigma^2)), not sigma_max.
    out = newton_schulz(g * sigma.norm(), steps, norm_scale=norm_scale).double()
    out = torch.linalg.svdvals(out)
    chain = torch.linalg.svdvals(_float64_chain(g, steps, 1e-7, norm_scale))
    top = chain[sigma * 1 / sigma.norm() >= 1e-2]
    assert top.min() >= low - 0.02 and top.max() <= high + 0.02, (top.min(), top.max())
    assert (out - chain).abs().max() < 0.1


def test_coefficients_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown ns_coefficients 'quintic'"):
        resolve_coefficients("quintic", 5)
    with pytest.raises(ValueError, match="2 triples for ns_steps=5"):
        resolve_coefficients([(1, 2, 3), (1, 2, 3)], 5)
    with pytest.raises(ValueError, match="ns_steps must be an int >= 1"):
        resolve_coefficients("keller", 0)
    assert resolve_coefficients((1.0, 2.0, 3.0), 2) == (((1.0, 2.0, 3.0),) * 2, 1.0)
    assert len(resolve_coefficients("polar_express", 7)[0]) == 7
    with pytest.raises(ValueError, match="matrix or a stack"):
        newton_schulz(torch.zeros(4), ((1.0, 0.0, 0.0),))
