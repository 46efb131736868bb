"""The AdamW update on one tensor (or one rank's piece of it), shared by both optimizers.

The operation order follows torch.optim.AdamW's single-tensor path (decoupled weight decay
first, `lerp` for the first moment), so an fp32 state gives torch's result.
"""

from __future__ import annotations

import torch


def check_betas(betas: object, name: str = "betas") -> tuple[float, float]:
    """Validates a (beta1, beta2) pair: both in [0, 1).

    Example:
        >>> check_betas((0.9, 0.999))
        (0.9, 0.999)
    """
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} ({name} in [0, 1))")
    return float(betas[0]), float(betas[1])


def check_nonnegative(value: object, name: str) -> float:
    """`value` as a float, or a ValueError naming it when it is negative or not a number.

    Example:
        >>> check_nonnegative(0.01, "weight_decay")
        0.01
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0.0:
        raise ValueError(f"Invalid {name}: {value!r} (must be a number >= 0)")
    return float(value)


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place on `param`, `exp_avg` and `exp_avg_sq` (same shapes).

    Args:
        param: The parameter (or its local piece), updated in place.
        grad: Its gradient.
        exp_avg: First moment, updated in place.
        exp_avg_sq: Second moment, updated in place.
        step: The step number, counting this one (>= 1).
        lr: Learning rate.
        betas: (beta1, beta2).
        eps: Added to the bias-corrected square root of the second moment.
        weight_decay: Decoupled weight decay (multiplies the parameter by 1 - lr * wd).

    Example:
        >>> p, g = torch.ones(2), torch.tensor([1.0, -1.0])
        >>> m, v = torch.zeros(2), torch.zeros(2)
        >>> adamw_step(p, g, m, v, step=1, lr=0.1, betas=(0.9, 0.999), eps=0.0,
        ...            weight_decay=0.0)
        >>> p  # the first step moves every element by lr
        tensor([0.9000, 1.1000])
    """
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
