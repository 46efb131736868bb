"""Per-parameter compute dtypes inside one group (FSDP2's `param_dtype_override_fn`).

torch 2.15's `MixedPrecisionPolicy.param_dtype_override_fn(param)` lets a parameter keep its
own dtype (an fp32 norm or router beside bf16 matrices) inside one `fully_shard` group; every
torch this package supports gets the same choice through `fully_shard`'s own
`param_dtype_override_fn` argument. The function is called once per parameter when the group
is built and must return None (use `param_dtype`), `param_dtype`, or the parameter's own
dtype. A group keeps one DBuffer per (dtype, compute dtype): one gather per compute dtype
present, each buffer cast once (or not at all) before its gather, and its gradients reduced
in `reduce_dtype`, else in its compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

OverrideFn = Callable[[nn.Parameter], torch.dtype | None]


def override_fn(policy: MixedPrecisionPolicy, given: OverrideFn | None) -> OverrideFn | None:
    """The override function: `fully_shard`'s argument or the policy's (torch 2.15+).

    Raises:
        TypeError: Either is not callable.
        ValueError: Both are given.
    """
    from_policy = getattr(policy, "param_dtype_override_fn", None)
    if given is not None and from_policy is not None:
        raise ValueError(
            "fully_shard got param_dtype_override_fn both as its argument and in mp_policy; "
            "give one"
        )
    found = given if given is not None else from_policy
    if found is not None and not callable(found):
        raise TypeError(f"param_dtype_override_fn must be callable, got {found!r}")
    return found


def compute_dtypes(
    policy: MixedPrecisionPolicy, fn: OverrideFn | None, params: Mapping[nn.Parameter, str]
) -> dict[nn.Parameter, torch.dtype | None]:
    """Each parameter's requested compute dtype: param_dtype, or None to keep its own.

    A parameter kept in its own dtype is None whatever dtype it has later; the others ask
    for param_dtype (the group compares it with the buffer's dtype when it gathers).

    Raises:
        ValueError: `fn` returned something other than None, `param_dtype` or the
            parameter's own dtype, naming the parameter.

    Example:
        >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        >>> norm, weight = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, 2))
        >>> keep_norms = lambda p: p.dtype if p.dim() == 1 else None
        >>> dtypes = compute_dtypes(policy, keep_norms, {norm: "norm", weight: "weight"})
        >>> dtypes[norm], dtypes[weight]
        (None, torch.bfloat16)
    """
    default = policy.param_dtype
    out: dict[nn.Parameter, torch.dtype | None] = {}
    for param, name in params.items():
        chosen: Any = default if fn is None else fn(param)
        if chosen is None:
            chosen = default
        if chosen is not None and not isinstance(chosen, torch.dtype):
            raise ValueError(
                f"param_dtype_override_fn must return a torch.dtype or None; for {name!r} it "
                f"returned {chosen!r}"
            )
        if chosen not in (default, param.dtype, None):
            raise ValueError(
                f"param_dtype_override_fn returned {chosen} for {name!r} ({param.dtype}); "
                f"valid: None, param_dtype ({default}) or the parameter's own {param.dtype}"
            )
        keeps_own = fn is not None and chosen == param.dtype and chosen != default
        out[param] = None if keeps_own else default
    return out
