"""ragged_placement: RaggedShard, a DTensor placement for uneven, block-granular shards.

Importing the package installs RaggedShard support into torch's own DTensor (see
`ragged_placement._compat`): `distribute_tensor`, `DTensor.from_local`, `redistribute`,
`full_tensor`, autograd through them, elementwise and `_foreach_*` ops, whole-tensor
`sum` / `mean` / `any` / `linalg_vector_norm` / `_foreach_norm`, reductions along dims and
joins (gathered), views that keep row-major order, torch's fused optimizer kernels, in-place
random fills
(`nn.init`) and loading full state dicts. DTensors without a RaggedShard are
left exactly as torch handles them.

Example (`mesh`: a 1-D DeviceMesh of one rank; `weight`: an 8 x 4 tensor):
    >>> import ragged_placement
    >>> from ragged_placement import RaggedShard
    >>> from torch.distributed.tensor import distribute_tensor
    >>> dt = distribute_tensor(weight, mesh, [RaggedShard((0,), (8,))])  # 4 ranks: (3, 1, 0, 4)
    >>> ragged_placement.local_view(dt).shape
    torch.Size([8, 4])
"""

import torch as _torch

from ragged_placement._comm_counter import Collective, CommCounter
from ragged_placement._compat import SUPPORTED_TORCH, check_torch_version
from ragged_placement._compat import install as _install
from ragged_placement._flat_runs import FlatRun, flat_runs, local_pieces, storage_order
from ragged_placement._integration import RaggedHooks as _RaggedHooks
from ragged_placement._placement import (
    RaggedShard,
    StridedRaggedShard,
    chunk_range,
    cut_dims_for,
)
from ragged_placement._views import flat_range, local_view, with_local, with_locals

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_TORCH",
    "Collective",
    "CommCounter",
    "FlatRun",
    "RaggedShard",
    "StridedRaggedShard",
    "__version__",
    "check_torch_version",
    "chunk_range",
    "cut_dims_for",
    "flat_range",
    "flat_runs",
    "local_pieces",
    "local_view",
    "storage_order",
    "with_local",
    "with_locals",
]

_install(_RaggedHooks())
# State dicts holding RaggedShard DTensors load with torch.load's default weights_only=True,
# as torch's own placements do.
_torch.serialization.add_safe_globals([RaggedShard, StridedRaggedShard])
