"""One parameter of a group: where it is registered, its forms, its tensor-parallel layout.

The per-parameter room below the group: `ParamGroup` (`_group.py`) and the tensor-subclass
parameters (`_subclass.py`) both build on it, and it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from dbuffer import DBuffer

Location = tuple[nn.Module, str]


@dataclass(frozen=True)
class ParallelSpec:
    """A parameter's sharding over other mesh axes (tensor or expert parallel), kept as given.

    The group gathers the local piece over its data-parallel axes; forward and backward see
    it as the DTensor the model was built with (same mesh, placements and global shape).
    With `dp_mesh_dims` that mesh holds the data axes too (`data_axes`, Replicate there).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    data_axes: tuple[int, ...] = ()

    @classmethod
    def of(cls, param: DTensor, data_axes: tuple[int, ...] = ()) -> ParallelSpec:
        return cls(
            param.device_mesh, tuple(param.placements), param.shape, param.stride(), data_axes
        )

    def wrap(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's piece) as the parameter's DTensor."""
        return DTensor.from_local(
            local, self.mesh, self.placements, shape=self.shape, stride=self.stride
        )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a gradient, in the parameter's placements (as FSDP2 does).

        A parameter replicated over the tensor-parallel axis may get a Partial gradient
        (e.g. a norm weight under sequence parallelism): it is reduced over that axis here.
        On data axes the gradient stays as it came (a Partial sum): the group reduces it.
        """
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(
            grad.placements[axis] if axis in self.data_axes else placement
            for axis, placement in enumerate(self.placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(self.mesh, target)
        return grad.to_local()


@dataclass(eq=False)
class ManagedParam:
    """One parameter of a group: where it is registered and its sharded / unsharded forms."""

    name: str  # its name in the DBuffer: the FQN relative to the fully_shard module
    locations: list[Location]  # every (module, attribute) it is registered under (tied weights)
    buffer: DBuffer
    sharded: nn.Parameter  # data: a RaggedShard DTensor over a view of buffer.local
    parallel: ParallelSpec | None = None  # for a DTensor parameter (TP / EP), else None
    unsharded: nn.Parameter | None = None  # made at the first unshard, then kept
    compute_dtype: torch.dtype | None = None  # the unshard dtype (mixed precision) or None

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad


def same_layout(a: DTensor, b: DTensor) -> bool:
    """Whether two DTensors have one mesh, placements and global shape."""
    return (
        a.device_mesh == b.device_mesh
        and tuple(a.placements) == tuple(b.placements)
        and a.shape == b.shape
    )
