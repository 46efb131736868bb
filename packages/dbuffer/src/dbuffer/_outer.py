"""DTensor entries: tensors already sharded over other mesh axes (tensor or expert parallel).

A DBuffer shards the local piece of such a tensor over its own axes, and the sharded view is
a DTensor over the DBuffer's axes followed by the tensor's: `(RaggedShard, Shard(1))` on a
(dp, tp) mesh for a row-parallel weight. RaggedShard cuts the block the other placements leave
(`ragged_placement`), which is exactly the local piece the DBuffer was given, so every
DTensor operation (`full_tensor`, `redistribute`, checkpoints, optimizers) sees the right
global tensor without the DBuffer knowing what the other axes mean.

A placement has to be the same on every rank, so the DBuffer of every rank of the other axes
must plan the same `local_units`. When a `Shard(d)` splits dim d unevenly (torch.chunk's
pieces: the first ranks hold one more), the plan is made for the first ranks' piece (its
`reference`) and a smaller piece fills a prefix of it: RaggedShard counts its units in that
reference block and cuts a smaller block's pieces off at its end (`_entries.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer._compat import concatenate_meshes


@dataclass(frozen=True)
class OuterSpec:
    """How a DTensor entry's sharded view extends over the tensor's own mesh axes.

    Attributes:
        mesh: The DBuffer's mesh axes followed by the tensor's (one mesh, one root).
        placements: The tensor's placements on its own axes.
        shape: The tensor's global shape.
        stride: The tensor's global stride.
        reference: The local piece of the first rank of every other axis: the largest
            (torch.chunk's), equal to every piece when the splits are even.
        uneven_dims: The dims some Shard(d) splits unevenly (the same on every rank).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    reference: torch.Size
    uneven_dims: tuple[int, ...]

    @property
    def uneven(self) -> bool:
        """Whether the pieces differ in shape between ranks of the other axes."""
        return bool(self.uneven_dims)


def _names(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    shape = tuple(mesh.shape)
    return f"mesh {shape} with axes {names}" if names else f"mesh {shape} without axis names"


def splits_unevenly(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor whose Shard placements leave its ranks unequal pieces.

    Such a tensor must be alone in its DBuffer (every rank plans it the same way there).

    Example:
        >>> splits_unevenly(torch.ones(3))
        False
    """
    if not isinstance(tensor, DTensor):
        return False
    return bool(_first_piece(tensor)[1])


def _first_piece(tensor: DTensor) -> tuple[torch.Size, tuple[int, ...]]:
    """The first ranks' local shape (torch.chunk's largest) and the dims split unevenly."""
    reference, uneven = list(tensor.shape), set()
    for axis, placement in enumerate(tensor.placements):  # in mesh order, as DTensor cuts
        if isinstance(placement, Shard):
            dim, parts = placement.dim % len(reference), tensor.device_mesh.size(axis)
            if reference[dim] % parts:
                uneven.add(dim)
            reference[dim] = -(-reference[dim] // parts)
    return torch.Size(reference), tuple(sorted(uneven))


def outer_spec(name: str, tensor: DTensor, mesh: DeviceMesh) -> OuterSpec:
    """Checks that DBuffer `mesh` can shard `tensor`'s local piece; returns its OuterSpec.

    Raises:
        ValueError: a placement other than Shard(d) / Replicate, or meshes that are not
            disjoint axes of one device mesh.
    """
    tensor_mesh = tensor.device_mesh
    for axis, placement in enumerate(tensor.placements):
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"DBuffer tensor {name!r} is a DTensor placed {placement!r} on axis {axis} of "
                f"its {_names(tensor_mesh)}; only Shard(d) and Replicate() can be sharded "
                f"further (redistribute a Partial first)"
            )
    reference, uneven = _first_piece(tensor)
    if tensor_mesh.device_type != mesh.device_type:
        raise ValueError(
            f"DBuffer tensor {name!r} is on a {tensor_mesh.device_type} mesh, the DBuffer's "
            f"mesh is {mesh.device_type}"
        )
    if not mesh.mesh_dim_names or not tensor_mesh.mesh_dim_names:
        raise ValueError(
            f"DBuffer tensor {name!r}: its {_names(tensor_mesh)} and the DBuffer's "
            f"{_names(mesh)} must both be named axes of one mesh (init_device_mesh(..., "
            f"mesh_dim_names=...), then mesh['dp'] and mesh['tp'])"
        )
    try:
        combined = concatenate_meshes([mesh, tensor_mesh])
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"DBuffer tensor {name!r}: its {_names(tensor_mesh)} and the DBuffer's "
            f"{_names(mesh)} are not disjoint axes of one device mesh ({exc}); slice both "
            f"from the same init_device_mesh, e.g. mesh['dp'] and mesh['tp']"
        ) from exc
    return OuterSpec(
        combined,
        tuple(tensor.placements),
        tensor.shape,
        tensor.stride(),
        reference,
        uneven,
    )


def check_rows_within_piece(name: str, outer: OuterSpec, local_rows: int, block_rows: int) -> None:
    """A block of `block_rows` rows may not straddle two ranks of another axis's Shard(0).

    A DTensor entry cut by rows on another axis holds `local_rows` consecutive rows of the
    global tensor; blocks are counted from the start of that piece, so they line up with the
    global tensor's blocks only when they tile the piece.

    Raises:
        ValueError: `block_rows` does not divide `local_rows`.
    """
    ndim = max(len(outer.shape), 1)
    if not any(isinstance(p, Shard) and p.dim % ndim == 0 for p in outer.placements):
        return
    if local_rows % block_rows:
        divisors = [d for d in range(1, local_rows + 1) if local_rows % d == 0]
        raise ValueError(
            f"block_rows={block_rows} for DBuffer tensor {name!r} does not divide its local "
            f"piece of {local_rows} rows (global shape {tuple(outer.shape)}, placements "
            f"{outer.placements}): a block would straddle two ranks of the row-sharded axis; "
            f"valid: {divisors}"
        )
