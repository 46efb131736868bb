"""Newton-Schulz orthogonalization: the matrix function at the heart of Muon.

For a matrix G with SVD U S V^T, `newton_schulz(G)` approximates U V^T by applying the odd
quintic p(x) = a x + b x^3 + c x^5 to the singular values a few times, in bfloat16. The input is
first divided by its Frobenius norm (so every singular value is <= 1) and, when it has more rows
than columns, transposed, so that the Gram matrix X X^T is the small one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Coefficients = tuple[tuple[float, float, float], ...]

# (a, b, c) per step. Keller Jordan's set repeats one triple; it maximizes the slope at zero, so
# singular values end in about [0.68, 1.13] rather than at exactly 1.
_KELLER = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al., 2025): one triple per step, with the input scaled by 1 / 1.02.
_POLAR_EXPRESS = (
    (8.1566, -22.4833, 15.8788),
    (4.0429, -2.8089, 0.5000),
    (3.8917, -2.7725, 0.5061),
    (3.2858, -2.3681, 0.4645),
    (2.3465, -1.7098, 0.4232),
)
NAMED_COEFFICIENTS = ("keller", "polar_express")


def resolve_coefficients(
    coefficients: str | Sequence[float] | Sequence[Sequence[float]], ns_steps: int
) -> tuple[Coefficients, float]:
    """One (a, b, c) per step and the norm multiplier, from a name or explicit triples.

    Args:
        coefficients: "keller", "polar_express", one (a, b, c) used for every step, or one
            triple per step.
        ns_steps: Number of Newton-Schulz steps, >= 1.

    Returns:
        (triples, norm_scale): `ns_steps` triples and the factor the Frobenius norm is
        multiplied by before dividing (1.02 for Polar Express, else 1).

    Example:
        >>> resolve_coefficients("keller", 2)
        (((3.4445, -4.775, 2.0315), (3.4445, -4.775, 2.0315)), 1.0)
    """
    steps: object = ns_steps  # user input: check what came
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
    if isinstance(coefficients, str):
        if coefficients == "keller":
            return (_KELLER,) * ns_steps, 1.0
        if coefficients == "polar_express":
            # Past its five tuned steps the last triple is repeated (it is near convergence).
            steps = _POLAR_EXPRESS + (_POLAR_EXPRESS[-1],) * max(0, ns_steps - 5)
            return steps[:ns_steps], 1.02
        raise ValueError(
            f"unknown ns_coefficients {coefficients!r}; valid: {', '.join(NAMED_COEFFICIENTS)} "
            f"or a sequence of (a, b, c)"
        )
    values = list(coefficients)
    if len(values) == 3 and all(isinstance(v, int | float) for v in values):
        values = [values]
    triples = []
    for triple in values:
        if isinstance(triple, str) or not isinstance(triple, Sequence) or len(triple) != 3:
            raise ValueError(
                f"ns_coefficients must be a name or (a, b, c) triples, got {coefficients!r}"
            )
        triples.append((float(triple[0]), float(triple[1]), float(triple[2])))
    if len(triples) == 1:
        return (triples[0],) * ns_steps, 1.0
    if len(triples) != ns_steps:
        raise ValueError(
            f"ns_coefficients gives {len(triples)} triples for ns_steps={ns_steps}; give one "
            f"triple or one per step"
        )
    return tuple(triples), 1.0


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: Coefficients,
    *,
    eps: float = 1e-7,
    norm_scale: float = 1.0,
) -> torch.Tensor:
    """Orthogonalizes a matrix, or each matrix of a (batch, rows, cols) stack, in bfloat16.

    Args:
        matrix: A 2-D matrix or a 3-D stack of matrices (any float dtype).
        coefficients: One (a, b, c) per step (see `resolve_coefficients`).
        eps: The norm is clamped to at least `eps`, so a zero matrix gives zeros.
        norm_scale: Multiplies the Frobenius norm before dividing by it.

    Returns:
        A bfloat16 tensor of the input's shape.

    Example:
        >>> steps, scale = resolve_coefficients("keller", 5)
        >>> out = newton_schulz(torch.eye(3) * 5.0, steps)
        >>> out.dtype, round(out[0, 0].item(), 2)  # singular values land in [0.68, 1.13]
        (torch.bfloat16, 0.68)
    """
    if matrix.ndim not in (2, 3):
        raise ValueError(
            f"newton_schulz takes a matrix or a stack, got shape {tuple(matrix.shape)}"
        )
    tall = matrix.size(-2) > matrix.size(-1)
    x = matrix.to(torch.bfloat16, copy=True)
    if tall:
        x = x.mT
    # One norm per matrix; a 2-D matrix takes torch.optim.Muon's exact reduction.
    norm = x.norm() if x.ndim == 2 else torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    if norm_scale != 1.0:
        norm = norm * norm_scale
    x = x / norm.clamp(min=eps)
    for a, b, c in coefficients:
        if x.ndim == 2:
            gram = x @ x.mT
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
        else:
            gram = torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x
