"""What a DBuffer holds: its entries' local pieces, and the layout planned for them.

A DTensor entry (tensor or expert parallel, over other axes of the same mesh) is held as its
local piece: the plan, the views and the gradients use the piece's shape, and `OuterSpec`
records how to wrap a sharded view back into a DTensor over both sets of axes.
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
    shapes: dict[str, torch.Size]
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
    specs = [
        TensorSpec.from_shape(name, t.shape, rows[name], num_shard_dims=cut_dims[name])
        for name, t in pieces
    ]
    for name, spec in outer.items():
        shape = shapes[name]
        num_rows = math.prod(shape[: cut_dims[name]]) if shape else 1
        # rows[name] was checked by TensorSpec above
        check_rows_within_piece(name, spec, num_rows, rows[name])
    align = check_align_bytes(align_bytes, pieces[0][1].element_size())
    planned = layout if layout is not None else plan_layout(specs, world, align=align)
    check_layout(planned, specs, world)
    return Entries(pieces, shapes, outer, planned)
