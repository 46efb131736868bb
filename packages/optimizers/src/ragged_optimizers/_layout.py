"""Where each rank's piece of a parameter lies, read from its placements without communication.

Both optimizers work on flat pieces: a parameter of global shape `shape` is split along one
mesh axis into contiguous ranges of its row-major flattening, one per rank (RaggedShard pieces
are such ranges by definition; FSDP2's Shard(0) chunks of whole rows are too). Every rank
computes every other rank's range from the placement alone, so plans made from layouts agree
on all ranks without a collective. Other mesh axes are Replicate (HSDP's replica axis: each
replica runs the same step) or, beside a RaggedShard, Shard(d) of tensor or expert
parallelism: RaggedShard then cuts the block those leave (this rank's tensor-parallel piece),
the ranges are ranges of that block, and `gather_blocks` / `take_blocks` go between blocks and
the whole tensors over the other axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ragged_placement import RaggedShard, chunk_range


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's global shape and every rank's flat range along its shard axis.

    Attributes:
        shape: The global (logical) shape, or with tensor / expert parallelism the block the
            shard axis cuts (this rank's piece over the other axes, the same shape on all).
        ranges: [start, end) of each rank's piece of the flattened tensor (or block), in rank
            order; one range covering everything for a plain or replicated tensor.
        rank: This rank's index on the shard axis (0 when not sharded).
        mesh: The DTensor's mesh, None for a plain tensor.
        placements: The DTensor's placements, () for a plain tensor.
        axis: The mesh axis the pieces are spread over, None when not sharded.
        global_shape: The whole tensor's shape when other axes shard it, else None.
    """

    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    rank: int = 0
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()
    axis: int | None = None
    global_shape: tuple[int, ...] | None = None  # set when other axes shard it (TP / EP)

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        if not self.ranges or self.ranges[0][0] != 0 or self.ranges[-1][1] != numel:
            raise ValueError(f"ranges {self.ranges} do not tile {numel} elements")
        if any(a[1] != b[0] for a, b in zip(self.ranges, self.ranges[1:], strict=False)):
            raise ValueError(f"ranges {self.ranges} are not contiguous and in rank order")
        if not 0 <= self.rank < len(self.ranges):
            raise ValueError(f"rank {self.rank} outside the {len(self.ranges)} ranges")

    @property
    def numel(self) -> int:
        """Elements of `shape` (the global tensor, or the block under tensor parallelism)."""
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (the matrix Muon orthogonalizes, AdamW8bit's block grid)."""
        return self.global_shape if self.global_shape is not None else self.shape

    @property
    def full_numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.full_shape)

    def _outer(self, count: int) -> tuple[DeviceMesh, list[Placement], torch.Size]:
        """The mesh, placements and shape of `count` stacked blocks over the other axes.

        Replicate on the shard axis; the stack's dim 0 is never split.
        """
        assert self.mesh is not None and self.global_shape is not None
        placements: list[Placement] = [
            Shard(p.dim % len(self.shape) + 1) if isinstance(p, Shard) else p
            for p in self.placements
        ]
        if self.axis is not None:
            placements[self.axis] = Replicate()
        return self.mesh, placements, torch.Size((count, *self.global_shape))

    def gather_blocks(self, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole tensors, (count, full_numel), from this rank's flat blocks of them.

        One collective for all of them over the axes that shard the tensor other than the
        shard axis (this rank and the ranks holding the other blocks of the same piece); a
        layout without such axes only stacks.
        """
        stacked = torch.stack([block.view(self.shape) for block in blocks])
        if self.global_shape is None:
            return stacked.view(len(blocks), -1)
        mesh, placements, shape = self._outer(len(blocks))
        spread = DTensor.from_local(
            stacked, mesh, placements, run_check=False, shape=shape, stride=_contiguous(shape)
        )
        return spread.full_tensor().view(len(blocks), -1)

    def tensor_parallel(self) -> tuple[int, int] | None:
        """(mesh axis, tensor dim) of the one other axis that splits the tensor, if one does.

        None without tensor parallelism, or when several axes split it.
        """
        if self.mesh is None or self.global_shape is None:
            return None
        split = [
            (axis, p.dim % len(self.shape))
            for axis, p in enumerate(self.placements)
            if axis != self.axis and isinstance(p, Shard) and self.mesh.size(axis) > 1
        ]
        return split[0] if len(split) == 1 else None

    def take_blocks(self, fulls: torch.Tensor) -> torch.Tensor:
        """This rank's flat blocks, (count, numel), of whole flat tensors (count, full_numel).

        No communication: each block is a slice.
        """
        if self.global_shape is None:
            return fulls
        mesh, placements, shape = self._outer(fulls.shape[0])
        whole = DTensor.from_local(
            fulls.view(shape), mesh, [Replicate()] * mesh.ndim, run_check=False
        )
        return whole.redistribute(mesh, placements).to_local().reshape(fulls.shape[0], -1)

    @property
    def num_ranks(self) -> int:
        """Ranks on the shard axis (1 when not sharded)."""
        return len(self.ranges)

    @property
    def local_range(self) -> tuple[int, int]:
        """This rank's [start, end)."""
        return self.ranges[self.rank]

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of the shard axis, None when not sharded."""
        if self.mesh is None or self.axis is None:
            return None
        return self.mesh.get_group(self.axis)

    def piece_rows(self, rank: int, row_numel: int) -> tuple[int, int] | None:
        """Rank's piece as [first row, end row) of `row_numel`-element rows, None if it cuts one."""
        lo, hi = self.ranges[rank]
        if lo == hi:  # an empty piece cuts nothing; its neighbours' ends are checked
            return (-(-lo // row_numel),) * 2 if row_numel else (0, 0)
        if row_numel == 0 or lo % row_numel or (hi % row_numel and hi != self.numel):
            return None
        return lo // row_numel, -(-hi // row_numel)

    def wrap(self, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`local` (this rank's piece, any shape of the right numel) laid out like `like`."""
        if not isinstance(like, DTensor):
            return local.view(self.shape)
        piece = like.to_local()
        return DTensor.from_local(
            local.view(piece.shape),
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )


def layout_of(tensor: torch.Tensor, what: str = "parameter") -> ParamLayout:
    """The layout of a plain tensor or of a DTensor sharded along at most one mesh axis.

    Args:
        tensor: A plain tensor, or a DTensor whose placements are Replicate except at most
            one RaggedShard or Shard(0), or one RaggedShard beside Shard(d) of tensor or
            expert parallelism (splitting their dims evenly).
        what: How to name the tensor in errors.

    Returns:
        Its ParamLayout.

    Example:
        >>> layout_of(torch.zeros(4, 3)).ranges
        ((0, 12),)
    """
    shape = tuple(tensor.shape)
    numel = math.prod(shape)
    if not isinstance(tensor, DTensor):
        return ParamLayout(shape, ((0, numel),))
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    sharded = [(a, p) for a, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not sharded:
        return ParamLayout(shape, ((0, numel),), 0, mesh, placements)
    ragged_axes = [a for a, p in sharded if isinstance(p, RaggedShard)]
    others = [(a, p) for a, p in sharded if not isinstance(p, RaggedShard)]
    if len(ragged_axes) == 1 and others and all(type(p) is Shard for _, p in others):
        ragged_axis = ragged_axes[0]
        ragged = placements[ragged_axis]
        assert isinstance(ragged, RaggedShard)
        block = _block_shape(shape, mesh, others, what, placements)
        ranges = ragged.flat_ranges(block, mesh.size(ragged_axis))
        rank = mesh.get_local_rank(ragged_axis)
        return ParamLayout(block, ranges, rank, mesh, placements, ragged_axis, global_shape=shape)
    axis, placement = sharded[0]
    ok = isinstance(placement, RaggedShard) or placement == Shard(0)
    if len(sharded) > 1 or not ok:
        raise ValueError(
            f"{what} has placements {placements}; ragged_optimizers supports Replicate on "
            f"every mesh axis but one, which holds RaggedShard or Shard(0), or one RaggedShard "
            f"beside Shard(d) of tensor / expert parallelism"
        )
    num_ranks = mesh.size(axis)
    if isinstance(placement, RaggedShard):
        ranges = placement.flat_ranges(shape, num_ranks)
    else:
        row = math.prod(shape[1:])
        rows = (chunk_range(shape[0], num_ranks, i) for i in range(num_ranks))
        ranges = tuple((lo * row, hi * row) for lo, hi in rows)
    return ParamLayout(shape, ranges, mesh.get_local_rank(axis), mesh, placements, axis)


def _block_shape(
    shape: tuple[int, ...],
    mesh: DeviceMesh,
    others: list[tuple[int, Placement]],
    what: str,
    placements: tuple[Placement, ...],
) -> tuple[int, ...]:
    """The piece every rank holds over the `others` axes (Shard(d), even splits only)."""
    block = list(shape)
    for axis, placement in others:
        assert isinstance(placement, Shard)
        dim = placement.dim % len(shape)
        parts = mesh.size(axis)
        if block[dim] % parts:
            raise ValueError(
                f"{what} has placements {placements}: {shape[dim]} of dim {dim} do not split "
                f"evenly over {parts} ranks; ragged_optimizers needs every rank's "
                f"tensor-parallel piece to have one shape"
            )
        block[dim] //= parts
    return tuple(block)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def local_flat(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor` as a flat view (no copy)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.view(-1)
