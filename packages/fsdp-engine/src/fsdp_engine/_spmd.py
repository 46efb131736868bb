"""`dp_mesh_dims`: `fully_shard` given the full SPMD mesh and the names of its data axes.

torch 2.13 added `DataParallelMeshDims` to FSDP2: instead of a data-parallel submesh, the
caller passes the whole (dp, tp, ...) mesh its DTensor parameters live on and names the axes
to shard (and to replicate, for HSDP) over. Here those names select the group's data-parallel
mesh (several names flattened into one axis, as FSDP2 does), and each DTensor parameter's
local piece is handed to its DBuffer as a DTensor over the remaining axes, which is what the
buffers shard further. Forward and backward still see the parameter as the model built it, on
the full mesh (`ParallelSpec` with its data axes), and gradients keep their data-axis
placement (a Partial sum to be reduce-scattered) until the group reduces them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from fsdp_engine._compat import flatten_axes


def _spmd_types() -> Any:
    """The spmd_types module (torchtitan's dependency), or None where it is not installed."""
    try:
        return importlib.import_module("spmd_types")
    except ImportError:
        return None


def _spmd_annotated(tensor: torch.Tensor) -> bool:
    """Whether `tensor` carries spmd_types annotations."""
    spmd_types = _spmd_types()
    return spmd_types is not None and bool(spmd_types.get_local_type(tensor))


def refuse_spmd_type_checking() -> None:
    """Raises while spmd_types type checking is on.

    Our gathers and reduces would run unannotated tensors through its checks, and gathered
    parameters carry no annotations.
    """
    if _spmd_types().is_type_checking():
        raise NotImplementedError(
            "fully_shard: parameters with spmd_types annotations train with spmd_types type "
            "checking off only (torchtitan: debug.spmd_typechecking=False, its default)"
        )


def _names(what: str, value: object, valid: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"dp_mesh_dims.{what} must be a str, a tuple of str or None, got {value!r}")
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"dp_mesh_dims.{what} names {unknown}, not axes of the mesh {valid}")
    return tuple(names)


@dataclass(frozen=True)
class SpmdMesh:
    """The full mesh, its data-parallel axes, and the group's data-parallel mesh."""

    full: DeviceMesh
    data_axes: tuple[int, ...]  # axes of `full` the group shards or replicates over
    dp_mesh: DeviceMesh  # 1-D (shard) or 2-D (replicate, shard)

    @classmethod
    def of(cls, mesh: object, dims: object) -> SpmdMesh:
        """Reads `fully_shard(mesh=..., dp_mesh_dims=...)`.

        Raises:
            TypeError: `mesh` is not a DeviceMesh or `dims` has no `shard` / `replicate`.
            ValueError: unnamed axes, unknown names, or no shard axis (DDP).
        """
        if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
            raise ValueError(
                f"dp_mesh_dims needs mesh: the full DeviceMesh with named axes "
                f"(init_device_mesh(..., mesh_dim_names=...)), got {mesh!r}"
            )
        if not hasattr(dims, "shard") or not hasattr(dims, "replicate"):
            raise TypeError(
                f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims (with "
                f"shard and replicate), got {dims!r}"
            )
        valid: tuple[str, ...] = tuple(mesh.mesh_dim_names)
        shard = _names("shard", dims.shard, valid)
        replicate = _names("replicate", dims.replicate, valid)
        if not shard:
            raise ValueError(
                f"dp_mesh_dims={dims!r} names no shard axis: fsdp_engine shards every group "
                f"(for replication alone use torch's replicate / DDP)"
            )
        if set(shard) & set(replicate):
            raise ValueError(f"dp_mesh_dims names {sorted(set(shard) & set(replicate))} twice")
        shard_mesh = flatten_axes(mesh, shard)
        if not replicate:
            dp_mesh = shard_mesh
        else:
            replicate_mesh = flatten_axes(mesh, replicate)
            pair = (replicate_mesh.mesh_dim_names[0], shard_mesh.mesh_dim_names[0])
            try:
                dp_mesh = mesh[pair]
            except (KeyError, RuntimeError, ValueError) as exc:
                raise ValueError(
                    f"dp_mesh_dims={dims!r}: cannot make one (replicate, shard) mesh of axes "
                    f"{pair} of {valid} on this torch ({exc})"
                ) from exc
        data_axes = tuple(valid.index(n) for n in (*replicate, *shard))
        return cls(mesh, tuple(sorted(data_axes)), dp_mesh)

    def _plain_on_data_axes(self, param: nn.Parameter, fqn: str) -> torch.Tensor:
        names = self.full.mesh_dim_names or ()
        other = [
            names[a]
            for a in range(self.full.ndim)
            if a not in self.data_axes and self.full.size(a) > 1  # one rank: nothing to split
        ]
        if other:
            raise NotImplementedError(
                f"parameter {fqn!r} is a plain tensor with spmd_types annotations on a mesh "
                f"with non-data axes {other}: fsdp_engine takes those only when every axis is "
                f"a data axis; make it a DTensor on the mesh (Shard/Replicate on {other})"
            )
        return param

    def split(self, param: nn.Parameter, fqn: str) -> torch.Tensor:
        """What the DBuffer shards for `param`: its piece on the non-data axes.

        A DTensor over the non-data axes, or the local tensor when there are none.

        Raises:
            ValueError: a plain tensor (as FSDP2), a DTensor on another mesh, or not
                Replicate on a data axis.
        """
        if not isinstance(param, DTensor) and _spmd_annotated(param):
            return self._plain_on_data_axes(param, fqn)
        if not isinstance(param, DTensor):
            raise ValueError(
                f"parameter {fqn!r} is a plain tensor; with dp_mesh_dims every parameter must "
                f"be a DTensor on fully_shard's mesh {self.full} (e.g. distribute_tensor(t, "
                f"mesh, [Replicate()] * mesh.ndim), or Shard(d) on tensor-parallel axes)"
            )
        if param.device_mesh != self.full:
            raise ValueError(
                f"parameter {fqn!r} is a DTensor on mesh {param.device_mesh}; with "
                f"dp_mesh_dims every DTensor parameter must be on fully_shard's mesh "
                f"{self.full}"
            )
        all_names = self.full.mesh_dim_names or ()
        for axis in self.data_axes:
            if not isinstance(param.placements[axis], Replicate):
                raise ValueError(
                    f"parameter {fqn!r} is {param.placements[axis]!r} on data axis "
                    f"{all_names[axis]!r} (placements {param.placements}); "
                    f"with dp_mesh_dims it must be Replicate() there: fully_shard shards it"
                )
        rest = [a for a in range(self.full.ndim) if a not in self.data_axes]
        if not rest:
            return param.to_local()  # data axes only: the DBuffer shards the whole tensor
        names = tuple(all_names[a] for a in rest)
        sub = self.full[names[0]] if len(names) == 1 else self.full[names]
        return DTensor.from_local(
            param.to_local(),
            sub,
            [param.placements[a] for a in rest],
            shape=param.shape,
            stride=param.stride(),
        )
