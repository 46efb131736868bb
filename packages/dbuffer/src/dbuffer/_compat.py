"""Every touch of a torch internal in dbuffer lives here, behind ragged_placement's version guard.

- `plain_tensor_ops()`: `torch._C.DisableTorchFunctionSubclass`, so that a tensor subclass's
  `__torch_function__` can run an op on its instances as plain tensors (without the default
  handler converting every output to the subclass).
- `set_version(tensor, version)`: `torch._C._autograd._unsafe_set_version_counter`, which sets
  the version counter that a tensor shares with its views (autograd compares it with the
  version a saved tensor had when it was saved).
- `profiler_range(name)`: `torch.profiler.record_function(name)` only while a profiler runs
  (`torch._C._autograd._profiler_enabled`): a range costs ~8 us even with no profiler.
- `all_gather_single` / `reduce_scatter_single`: torch.distributed's names since 2.13; before,
  the same collectives are `all_gather_into_tensor` / `reduce_scatter_tensor` (chosen once,
  by which name exists).
- `is_view(t)`, `base_of(t)`, `storage_key(t)`, `version_of(t)`, `TENSOR_IS_VIEW`,
  `TENSOR_DATA_GET`: a tensor's `_is_view()` and `_base`, its storage's `_cdata` (which
  storage it aliases), its autograd `_version`, and the functions `Tensor._is_view` /
  `Tensor.data.__get__` as `__torch_function__` sees them (the debug guard of `_views.py`
  matches on them).
- `concatenate_meshes(meshes)`: `DeviceMesh._concatenate`, the mesh made of disjoint axes of
  one root mesh (a DTensor entry's sharded view lives on the DBuffer's axes and its own).
- `foreach_copy_(dst, src)` / `foreach_add_(dst, src)`: `torch._foreach_copy_` /
  `torch._foreach_add_`, one dispatch for a whole list of tensors (casting as `copy_` does).
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from ragged_placement import check_torch_version

__all__ = [
    "TENSOR_DATA_GET",
    "TENSOR_IS_VIEW",
    "all_gather_single",
    "base_of",
    "concatenate_meshes",
    "foreach_add_",
    "foreach_copy_",
    "is_view",
    "plain_tensor_ops",
    "profiler_range",
    "reduce_scatter_single",
    "set_version",
    "storage_key",
    "version_of",
]


def plain_tensor_ops() -> AbstractContextManager[None]:
    """Context in which `__torch_function__` overrides of tensor subclasses are skipped."""
    return torch._C.DisableTorchFunctionSubclass()


def set_version(tensor: torch.Tensor, version: int) -> None:
    """Sets the version counter of `tensor` and of every view sharing it."""
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


# (output, input, ..., group=, async_op=): the same arguments under either name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_NO_RANGE = nullcontext()


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A profiler range named `name` while a profiler runs, else a no-op context."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for every i, in one dispatch."""
    torch._foreach_copy_(list(dst), list(src))


def foreach_add_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """`dst[i].add_(src[i])` for every i, in one dispatch."""
    torch._foreach_add_(list(dst), list(src))


check_torch_version("dbuffer")


TENSOR_IS_VIEW = torch.Tensor._is_view
TENSOR_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]


def is_view(tensor: torch.Tensor) -> bool:
    """Whether autograd records `tensor` as a view of another tensor."""
    return tensor._is_view()


def base_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of (None if it is not a view)."""
    return tensor._base


def storage_key(tensor: torch.Tensor) -> int:
    """An id of the storage `tensor` aliases, shared by every view of it."""
    key: int = tensor.untyped_storage()._cdata
    return key


def version_of(tensor: torch.Tensor) -> int:
    """The autograd version counter `tensor` shares with its views."""
    return tensor._version


def concatenate_meshes(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of `meshes` in order (disjoint axes of one root mesh).

    `DeviceMesh._concatenate` (torch 2.10 and later; what FSDP2 builds its DP x TP mesh with).
    It reuses the axes' process groups. Raises RuntimeError for meshes of different roots or
    overlapping axes.
    """
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no DeviceMesh._concatenate, needed to "
            f"shard DTensors over another mesh axis"
        )
    combined: DeviceMesh = concatenate(list(meshes))
    return combined
