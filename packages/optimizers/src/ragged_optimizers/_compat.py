"""Every touch of a torch internal in ragged_optimizers lives here.

- `compile_options()`: inductor settings for the blockwise AdamW8bit pass, passed through
  `torch.compile(options=...)`; each is included only where this torch's inductor config has
  it. `assert_indirect_indexing=False` drops the bounds check of every table read (the
  indices are a uint8 code or a 17-bit key, in range by construction; the check costs a
  compare and a branch per element).
- `mark_dims_dynamic(tensors, dims)`: `torch._dynamo.maybe_mark_dynamic`, so that one
  compilation serves every number of blocks while the block's own sizes stay constants
  (`dynamic=True` would make them symbolic too, and every index then needs a division).
- `foreach_add_`, `foreach_lerp`, `foreach_lerp_`, `foreach_mul_`: torch's multi-tensor
  ops (`torch._foreach_*`, what torch.optim's foreach paths run), underscored in torch
  though stable across the supported versions.
- `all_gather_single`: torch.distributed's name since 2.13 (the old one warns there); before,
  the same collective is `all_gather_into_tensor` (chosen once, by which name exists).
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single",
    "compile_options",
    "foreach_add_",
    "foreach_lerp",
    "foreach_lerp_",
    "foreach_mul_",
    "mark_dims_dynamic",
]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
foreach_add_ = torch._foreach_add_
foreach_lerp = torch._foreach_lerp
foreach_lerp_ = torch._foreach_lerp_
foreach_mul_ = torch._foreach_mul_


def compile_options() -> dict[str, Any]:
    """Inductor options for the blockwise update that this torch knows.

    Example:
        >>> compile_options().get("assert_indirect_indexing", False)
        False
    """
    try:
        from torch._inductor import config
    except ImportError:  # no inductor: torch.compile fails and the caller runs eagerly
        return {}
    wanted = {"assert_indirect_indexing": False}
    return {key: value for key, value in wanted.items() if hasattr(config, key)}


def mark_dims_dynamic(tensors: Iterable[torch.Tensor], dims: Iterable[int]) -> None:
    """Asks torch.compile to treat these dims of these tensors (where they exist) as symbolic.

    Example:
        >>> mark_dims_dynamic([torch.zeros(2, 3)], (0,))
    """
    from torch._dynamo import maybe_mark_dynamic

    dims = tuple(dims)
    for tensor in tensors:
        for dim in dims:
            if dim < tensor.dim():
                maybe_mark_dynamic(tensor, dim)
