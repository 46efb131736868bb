"""Each tensor's piece of a DBuffer shard, as a RaggedShard DTensor viewing the shard.

The same cut serves the parameters (over `local`) and the reduced gradients (over
`local_grad`): one `split_with_sizes` yields every piece, and the gradients' DTensors reuse
the parameters' specs (`with_locals`), so building them costs one constructor each.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from dbuffer._outer import OuterSpec
from ragged_placement import RaggedShard, cut_dims_for, with_locals
from shard_planner import Layout

# Per tensor: this rank's (start, end) in the shard, or the shape of an empty tensor.
_Piece = tuple[int, int, torch.Size | None]


def _split_plan(pieces: Mapping[str, _Piece], size: int) -> tuple[list[int], dict[str, int]]:
    """How one `split` cuts a shard of `size` elements into its tensors' pieces.

    Returns the split sizes (pieces and the gaps between them) and, per non-empty tensor,
    the index of its piece among the chunks.
    """
    sizes: list[int] = []
    at: dict[str, int] = {}
    end = 0
    ranges = sorted((lo, hi, n) for n, (lo, hi, shape) in pieces.items() if shape is None)
    for lo, hi, name in ranges:
        if lo < end:
            raise AssertionError(f"pieces overlap at {name!r}: [{lo}, {hi}) starts before {end}")
        if lo > end:
            sizes.append(lo - end)
        at[name] = len(sizes)
        sizes.append(hi - lo)
        end = hi
    if end < size:
        sizes.append(size - end)
    return sizes, at


def held_range(layout: Layout, name: str, rank: int, numel: int) -> tuple[int, int]:
    """`rank`'s [start, end) of tensor `name` in its shard, cut off where the tensor ends.

    The planned range, unless the tensor is smaller than its plan (an uneven
    tensor-parallel piece, `_entries.py`): then the last ranks hold less of it, or nothing.
    """
    lo, hi = layout.local_range(name, rank)
    end = layout.offsets[name] + numel - rank * layout.shard_size  # in the rank's coordinates
    hi = max(lo, min(hi, end))
    return lo, hi


class ShardViews:
    """Cuts a flat shard of S elements into its tensors' sharded DTensors.

    Args:
        layout: The buffer's layout.
        shapes: Each tensor's (local piece's) shape, in the caller's order.
        outer: DTensor entries' specs over their own mesh axes (`_outer.py`).
        mesh: The buffer's mesh.
        shard_axis: The mesh axis the buffer is sharded over.
        local: The parameters' shard; `of_local` holds its views.
    """

    def __init__(
        self,
        layout: Layout,
        shapes: Mapping[str, torch.Size],
        outer: Mapping[str, OuterSpec],
        mesh: DeviceMesh,
        shard_axis: int,
        local: torch.Tensor,
    ) -> None:
        self._layout, self._shapes, self._outer = layout, shapes, outer
        self._mesh, self._shard_axis = mesh, shard_axis
        rank = mesh.get_local_rank(shard_axis)
        self._pieces: dict[str, _Piece] = {
            name: (0, 0, shape)
            if layout.spec(name).numel == 0
            else (*held_range(layout, name, rank, shape.numel()), None)
            for name, shape in shapes.items()
        }
        self._split_sizes, self._split_at = _split_plan(self._pieces, layout.shard_size)
        self.of_local = {name: self._make(name, local) for name in shapes}

    def placements(self, name: str) -> list[Placement]:
        """`name`'s placements on the buffer's mesh."""
        placements: list[Placement] = [Replicate()] * self._mesh.ndim
        if self._layout.spec(name).numel:  # else nothing to shard: replicated (empty) pieces
            unit = self._layout.unit(name)
            placements[self._shard_axis] = RaggedShard(
                cut_dims_for(tuple(self._shapes[name]), unit), self._layout.local_units(name)
            )
        return placements

    def pieces(self, names: list[str], storage: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of `names` in `storage` (a shard of S elements), as plain views."""
        # One split cuts every piece (a slice each costs 4x more); it runs for every
        # parameter each step. Empty tensors get an empty view of their own shape.
        chunks = torch.split_with_sizes(storage, self._split_sizes)
        at, pieces = self._split_at, self._pieces
        return [
            chunks[at[name]] if name in at else storage[0:0].view(pieces[name][2])  # type: ignore[arg-type]
            for name in names
        ]

    def _make(self, name: str, storage: torch.Tensor) -> DTensor:
        (piece,) = self.pieces([name], storage)
        outer = self._outer.get(name)
        if outer is not None:
            placements = [*self.placements(name), *outer.placements]
            return DTensor.from_local(
                piece, outer.mesh, placements, shape=outer.shape, stride=outer.stride
            )
        if self._layout.spec(name).numel == 0:  # nothing to shard: an empty replicated view
            return DTensor.from_local(piece, self._mesh, self.placements(name))
        return DTensor.from_local(
            piece, self._mesh, self.placements(name), shape=self._shapes[name]
        )

    def views_of(self, storage: torch.Tensor) -> dict[str, DTensor]:
        """Every tensor's sharded DTensor over `storage`, with the specs of `of_local`'s."""
        # Built at once from the parameters' specs (from_local's checks hold for them): this
        # runs once per step for every parameter of a group.
        names = list(self._shapes)
        made = with_locals([self.of_local[name] for name in names], self.pieces(names, storage))
        return dict(zip(names, made, strict=True))
