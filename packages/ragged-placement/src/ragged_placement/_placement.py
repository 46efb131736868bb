"""RaggedShard: uneven, block-granular sharding of a tensor's row-major flattening.

The tensor (or the local block left by the other placements of its mesh) is viewed flat and
cut into one contiguous piece per rank of one mesh axis. `local_units[r]` is rank r's share:
with unit = numel / sum(local_units) elements, rank r holds the flat range
[unit * sum(local_units[:r]), unit * sum(local_units[:r + 1])). `dims` is a prefix (0..k-1)
of the tensor dims that may be cut; the trailing dims shape[k:] are never cut, so every piece
is a whole number of rows and a unit is a whole number of rows. The local tensor is always
1-D; `local_view` shows it as (-1, *shape[k:]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor.placement_types import Placement


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when torch.chunk splits `size` into `parts` (Shard(d)).

    Example:
        >>> [chunk_range(10, 4, i) for i in range(4)]  # chunks of ceil(10 / 4) = 3
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    if size < 0 or parts < 1 or not 0 <= index < parts:
        raise ValueError(
            f"chunk_range needs size >= 0, parts >= 1 and 0 <= index < parts; got size={size}, "
            f"parts={parts}, index={index}"
        )
    chunk = -(-size // parts) if size else 0
    lo = min(index * chunk, size)
    return lo, min(lo + chunk, size)


def cut_dims_for(shape: tuple[int, ...], unit: int) -> tuple[int, ...]:
    """The fewest leading dims of `shape` whose rows a piece of `unit` elements is made of.

    A RaggedShard whose every piece is a multiple of `unit` elements may declare these as
    its `dims` (a view of the tensor keeps its pieces under the new shape with them).

    Example:
        >>> cut_dims_for((4, 3, 2), 6), cut_dims_for((4, 3, 2), 2), cut_dims_for((4, 3, 2), 1)
        ((0,), (0, 1), (0, 1, 2))

    Raises:
        ValueError: a negative size in `shape`, or a `unit` that is not an int >= 0.
    """
    sizes = _as_int_tuple("cut_dims_for shape", shape)
    if any(size < 0 for size in sizes) or isinstance(unit, bool) or not isinstance(unit, int):
        raise ValueError(f"cut_dims_for needs sizes >= 0 and an int unit, got {shape}, {unit!r}")
    if unit < 0:
        raise ValueError(f"cut_dims_for unit must be >= 0, got {unit}")
    for k in range(1, len(sizes)):
        row = math.prod(sizes[k:])
        if row == 0 or unit % row == 0:  # an empty tensor: any cut is whole rows
            return tuple(range(k))
    return tuple(range(max(len(sizes), 1)))


def _as_int_tuple(what: str, values: object) -> tuple[int, ...]:
    if isinstance(values, int) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a tuple of ints, got {values!r}")
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what} must hold ints, got {v!r} in {values!r}")
    return out


class RaggedShard(Placement):
    """Shards the flattened tensor into contiguous, uneven pieces along one mesh axis.

    Args:
        dims: The tensor dims that may be cut, a prefix (0, 1, ..., k-1); rows of
            shape[k:] are never split.
        local_units: One relative share per rank of the mesh axis, >= 0, not all zero.
            A one-hot tuple puts the whole tensor on one rank.

    Example:
        >>> RaggedShard((0,), (1, 2, 1, 0)).flat_ranges((8, 3), num_ranks=4)
        ((0, 6), (6, 18), (18, 24), (24, 24))
    """

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]) -> None:
        super().__init__()
        dims_t = _as_int_tuple("RaggedShard dims", dims)
        units_t = _as_int_tuple("RaggedShard local_units", local_units)
        if not dims_t or dims_t != tuple(range(len(dims_t))):
            raise ValueError(
                f"RaggedShard dims must be a non-empty prefix (0, 1, ..., k-1) of the tensor "
                f"dims, got {dims_t}"
            )
        if not units_t:
            raise ValueError("RaggedShard local_units must have one entry per rank, got ()")
        if any(u < 0 for u in units_t):
            raise ValueError(f"RaggedShard local_units must be >= 0, got {units_t}")
        if not any(units_t):
            raise ValueError(f"RaggedShard local_units must not be all zero, got {units_t}")
        object.__setattr__(self, "dims", dims_t)
        object.__setattr__(self, "local_units", units_t)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RaggedShard is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is RaggedShard
            and self.dims == other.dims
            and self.local_units == other.local_units
        )

    def __hash__(self) -> int:
        return hash((RaggedShard, self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS{self.local_units}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RaggedShard, (self.dims, self.local_units))

    # -- math -------------------------------------------------------------------------------

    def row_numel(self, shape: Sequence[int]) -> int:
        """Elements per uncuttable row: prod(shape[len(dims):])."""
        if len(self.dims) > max(len(shape), 1):
            raise ValueError(
                f"RaggedShard dims {self.dims} cut more dims than the tensor has (shape "
                f"{tuple(shape)})"
            )
        return math.prod(shape[len(self.dims) :])

    def unit_numel(self, shape: Sequence[int]) -> int:
        """Elements per unit; raises ValueError unless units are whole rows of shape."""
        numel = math.prod(shape)
        total = sum(self.local_units)
        unit, rest = divmod(numel, total)
        row = self.row_numel(shape)
        if rest or (row and unit % row):
            raise ValueError(
                f"{self!r} cannot shard shape {tuple(shape)}: {numel} elements must split "
                f"into {total} units of whole rows of {row} elements"
            )
        return unit

    def flat_ranges(
        self, shape: Sequence[int], num_ranks: int, reference: Sequence[int] | None = None
    ) -> tuple[tuple[int, int], ...]:
        """[start, end) of every rank's piece in the flattened tensor (or block).

        Args:
            shape: The block cut: the tensor, or what the other placements leave this rank.
            num_ranks: The mesh axis's size.
            reference: The block the units are counted in, when another axis splits the
                tensor unevenly (torch.chunk's Shard(d)) and `shape` is a smaller block: one
                placement serves every block, so its units are rows of the largest block
                (the first ranks'), and a block with fewer rows holds the same row ranges
                cut off at its end (one with shorter rows, the same rows). Default: `shape`.

        Example:
            >>> RaggedShard((0,), (2, 2)).flat_ranges((3, 4), 2, reference=(4, 4))
            ((0, 8), (8, 12))
        """
        if num_ranks != len(self.local_units):
            raise ValueError(
                f"{self!r} has {len(self.local_units)} local_units but the mesh axis has "
                f"{num_ranks} ranks"
            )
        if reference is None or tuple(reference) == tuple(shape):
            unit, row = self.unit_numel(shape), 1  # units of `unit` elements
        else:  # units of whole rows of the reference, `row` elements each here
            ref_row = _check_reference(self, shape, reference)
            unit, row = (
                (self.unit_numel(reference) // ref_row if ref_row else 0),
                (self.row_numel(shape)),
            )
        numel = math.prod(shape)
        ranges = []
        start = 0
        for units in self.local_units:
            end = start + units * unit
            ranges.append((min(start * row, numel), min(end * row, numel)))
            start = end
        return tuple(ranges)

    def flat_range(
        self, shape: Sequence[int], rank: int, reference: Sequence[int] | None = None
    ) -> tuple[int, int]:
        """[start, end) of `rank`'s piece in the flattened tensor (see `flat_ranges`)."""
        return self.flat_ranges(shape, len(self.local_units), reference)[rank]


def _check_reference(placement: RaggedShard, shape: Sequence[int], reference: Sequence[int]) -> int:
    """Checks that rows of `reference` can stand for rows of `shape`; returns its row size.

    The same dims, at least as many rows along dim 0, the same sizes of the other cut dims
    (so the rows of both are numbered alike); the rows themselves may differ in length.
    """
    cut = len(placement.dims)
    if (
        len(reference) != len(shape)
        or not shape
        or reference[0] < shape[0]
        or tuple(reference[1:cut]) != tuple(shape[1:cut])
    ):
        raise ValueError(
            f"{placement!r}: the reference block {tuple(reference)} cannot count the rows of "
            f"the block {tuple(shape)} (it needs as many dims, at least as many along dim 0 "
            f"and the same sizes of the cut dims 1..{cut - 1})"
        )
    return placement.row_numel(reference)


class StridedRaggedShard(Placement):
    """A ragged cut of the whole tensor, each piece then split by a Shard(0) of another axis.

    Plain `RaggedShard` cuts the block left by the other axes (so `[Shard(0), RaggedShard]` on
    an (ep, fsdp) mesh shards each expert block raggedly). `StridedRaggedShard` records the
    other order: the tensor's rows are first cut into ragged pieces by `local_units` on this
    axis, and a `Shard(0)` on another mesh axis of size `split_factor` then splits every piece
    by rows (torch.chunk semantics). The local tensor of rank (r, t) is chunk t of piece r,
    flat. `full_tensor()` and every redistribute rebuild the global layout from that.

    Args:
        dims: Must be (0,): pieces are whole rows of shape[1:], and so are their chunks.
        local_units: One relative share per rank of this mesh axis (see RaggedShard).
        split_factor: Size of the mesh axis whose Shard(0) splits each piece, >= 1.

    Example:
        >>> StridedRaggedShard((0,), (3, 1), split_factor=2).piece_rows((8, 5), num_ranks=2)
        ((0, 6), (6, 8))
    """

    ragged: RaggedShard
    split_factor: int

    def __init__(self, dims: Sequence[int], local_units: Sequence[int], split_factor: int) -> None:
        super().__init__()
        ragged = RaggedShard(dims, local_units)
        if ragged.dims != (0,):
            raise ValueError(
                f"StridedRaggedShard cuts whole rows: dims must be (0,), got {ragged.dims}"
            )
        factor: object = split_factor  # callers may pass anything; check before trusting the hint
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ValueError(
                f"StridedRaggedShard split_factor must be an int >= 1, got {split_factor!r}"
            )
        object.__setattr__(self, "ragged", ragged)
        object.__setattr__(self, "split_factor", split_factor)

    @property
    def dims(self) -> tuple[int, ...]:
        """The cut dims, always (0,)."""
        return self.ragged.dims

    @property
    def local_units(self) -> tuple[int, ...]:
        """Each rank's share of the rows of this axis."""
        return self.ragged.local_units

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StridedRaggedShard is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is StridedRaggedShard
            and self.ragged == other.ragged
            and self.split_factor == other.split_factor
        )

    def __hash__(self) -> int:
        return hash((StridedRaggedShard, self.ragged, self.split_factor))

    def __repr__(self) -> str:
        return (
            f"StridedRaggedShard(dims={self.dims}, local_units={self.local_units}, "
            f"split_factor={self.split_factor})"
        )

    def __str__(self) -> str:
        return f"SRS{self.local_units}/{self.split_factor}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (StridedRaggedShard, (self.dims, self.local_units, self.split_factor))

    def piece_rows(self, shape: Sequence[int], num_ranks: int) -> tuple[tuple[int, int], ...]:
        """[first row, end row) of every rank's piece along dim 0."""
        row = self.ragged.row_numel(shape)
        return tuple(
            (lo // row, hi // row) if row else (0, 0)
            for lo, hi in self.ragged.flat_ranges(shape, num_ranks)
        )

    def chunk_rows(
        self, shape: Sequence[int], num_ranks: int, rank: int, part: int
    ) -> tuple[int, int]:
        """[first row, end row) that rank `rank` of this axis and part `part` of the split hold."""
        first, end = self.piece_rows(shape, num_ranks)[rank]
        lo, hi = chunk_range(end - first, self.split_factor, part)
        return first + lo, first + hi
