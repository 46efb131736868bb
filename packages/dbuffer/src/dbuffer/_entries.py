"""What a DBuffer holds: its entries' local pieces, and the layout planned for them.

A DTensor entry (tensor or expert parallel, over other axes of the same mesh) is held as its
local piece: the views and the gradients use the piece's shape, and `OuterSpec` records how to
wrap a sharded view back into a DTensor over both sets of axes.

An entry split unevenly over its other axes is planned as the first ranks' (largest) rows with
its own row length, alone in its buffer, rows dealt in whole blocks as torch.chunk deals them:
so every rank of the other axes plans the same units per rank of the shard axis (one
RaggedShard placement for all), and a smaller piece fills a prefix of the planned rows, the
last ranks' pieces cut off at its end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dbuffer._checks import (
    BlockRows,
    block_rows_by_name,
    check_align_bytes,
    check_layout,
    check_num_shard_dims,
    check_tensors,
)
from dbuffer._outer import OuterSpec, check_rows_within_piece, outer_spec
from shard_planner import Layout, TensorSpec, plan_layout


@dataclass(frozen=True)
class Entries:
    """The checked entries of one buffer and their layout over the shard axis."""

    tensors: list[tuple[str, torch.Tensor]]  # local pieces, in the order given
    shapes: dict[str, torch.Size]  # the pieces' shapes (the layout plans `planned`)
    outer: dict[str, OuterSpec]  # the DTensor entries' other axes
    layout: Layout


def plan_entries(
    tensors: Sequence[tuple[str, torch.Tensor]],
    mesh: DeviceMesh,
    world: int,
    *,
    block_rows: BlockRows,
    num_shard_dims: int | Mapping[str, int],
    align_bytes: int,
    layout: Layout | None,
) -> Entries:
    """Checks `DBuffer`'s tensors and plans them (or checks the `layout` given) for `world`."""
    pieces = list(tensors)
    given = list(tensors)  # what a block_rows function sees
    outer: dict[str, OuterSpec] = {}
    for index, (name, t) in enumerate(pieces):
        if isinstance(t, DTensor):
            outer[name] = outer_spec(name, t, mesh)
            with torch.no_grad():
                pieces[index] = (name, t.to_local())
    check_tensors(pieces)
    rows = block_rows_by_name(block_rows, given)
    cut_dims = check_num_shard_dims(num_shard_dims, pieces)
    shapes = {name: t.shape for name, t in pieces}
    planned_shapes = {
        name: _planned_shape(name, shapes[name], outer[name], cut_dims[name])
        if name in outer
        else shapes[name]
        for name in shapes
    }
    specs = [
        TensorSpec.from_shape(name, planned_shapes[name], rows[name], num_shard_dims=cut_dims[name])
        for name, _ in pieces
    ]
    for name, spec in outer.items():
        shape = planned_shapes[name]
        num_rows = math.prod(shape[: cut_dims[name]]) if shape else 1
        # rows[name] was checked by TensorSpec above
        check_rows_within_piece(name, spec, num_rows, rows[name])
    align = check_align_bytes(align_bytes, pieces[0][1].element_size())
    uneven = [name for name, spec in outer.items() if spec.uneven]
    if uneven:
        if len(pieces) > 1 or layout is not None:
            raise ValueError(
                f"DBuffer tensor {uneven[0]!r} is split unevenly over its other mesh axes "
                f"(local piece {tuple(shapes[uneven[0]])}, first ranks' "
                f"{tuple(planned_shapes[uneven[0]])}); such a tensor must be alone in its "
                f"DBuffer, with no layout given (every rank then plans the same units)"
            )
        layout = chunk_layout(specs[0], world)
    planned = layout if layout is not None else plan_layout(specs, world, align=align)
    check_layout(planned, specs, world)
    return Entries(pieces, shapes, outer, planned)


def _planned_shape(name: str, shape: torch.Size, outer: OuterSpec, cut: int) -> torch.Size:
    """What the plan holds of a DTensor entry: the first ranks' rows, this piece's row length."""
    reference = outer.reference
    if any(0 < dim < cut for dim in outer.uneven_dims):  # decided alike on every rank
        raise ValueError(
            f"DBuffer tensor {name!r} (global shape {tuple(outer.shape)}, placements "
            f"{outer.placements}) is split unevenly on a dim among dims 1..{cut - 1}, which "
            f"the shard axis cuts too; an uneven split may fall on dim 0 or on the dims "
            f"after num_shard_dims={cut}"
        )
    return torch.Size([reference[0], *shape[1:]]) if outer.uneven else shape


def chunk_layout(spec: TensorSpec, world: int) -> Layout:
    """One tensor dealt over `world` ranks in whole blocks as torch.chunk deals: its own layout.

    Example:
        >>> chunk_layout(TensorSpec.from_shape("w", (14, 9), block_rows=1), 2).local_units("w")
        (7, 7)
    """
    blocks = -(-spec.numel // spec.block) if spec.block else 0
    per_rank = -(-blocks // world)
    return Layout(world, per_rank * spec.block, (spec,), (0,), align=1)
