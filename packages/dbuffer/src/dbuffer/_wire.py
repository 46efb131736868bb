"""A low-precision wire format for the all-gather: fp8 codes with one fp32 scale per block.

`BlockFloat8(block=(rows, cols))` sends each tensor as float8 codes (1 byte per element) plus
one float32 scale per block of `rows` x `cols` elements of its 2-D view (leading dims
flattened, the last dim as columns): scale = absmax / (the format's largest value), code =
x / scale. The rank that holds a block computes its scale from its own shard, so the result
is exact only where no shard boundary cuts a block: the planner's unit of the tensor (what a
boundary is a multiple of) must be a multiple of `rows` whole rows. Then every rank holds
whole blocks and the gathered, dequantized weight is bit for bit the quantize-dequantize of
the full tensor in one process (FSDP2's float8 gathers are tensorwise for this reason: its
even shards cut blocks).

On the wire per rank: S bytes of codes (gloo, which has no fp8 type, moves them as uint8)
and the scales of this rank's blocks, padded to the largest count any rank has. The full
views stay in the compute dtype: one quantize pass over the shard before the gather, one
dequantize pass into the views after it, and the codes and scales are freed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from dbuffer._comm import ShardComm, Works
from shard_planner import Layout

FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class BlockFloat8:
    """All-gather parameters as float8 codes with one float32 scale per block.

    Args:
        block: (rows, cols) of a tensor's 2-D view (leading dims flattened) that share one
            scale. No shard boundary may cut the rows: give the group a `block_rows` that is a
            multiple of `rows` (the tensor's row count a multiple of it too).
        dtype: torch.float8_e4m3fn (precision) or torch.float8_e5m2 (range).

    Example:
        >>> fmt = BlockFloat8(block=(32, 128))
        >>> fmt.max_value
        448.0
    """

    block: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        block: object = self.block
        if (
            not isinstance(block, tuple)
            or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in block)
        ):
            raise ValueError(f"BlockFloat8 block must be (rows, cols), ints >= 1, got {block!r}")
        if self.dtype not in FLOAT8_DTYPES:
            valid = ", ".join(str(d) for d in FLOAT8_DTYPES)
            raise ValueError(f"BlockFloat8 dtype must be one of {valid}; got {self.dtype!r}")

    @property
    def max_value(self) -> float:
        """The largest finite value of the format: what a block's absmax maps to."""
        return float(torch.finfo(self.dtype).max)


Regions = list[tuple[torch.Tensor, int, int]]


def _regions(x: torch.Tensor, block: tuple[int, int]) -> Regions:
    """`x` (R, C) as up to four regions of equal blocks (the bottom and right edges smaller).

    Each is (region as (row blocks, rows, col blocks, cols), first row block, first col
    block): slices and unflattens of `x`, no copies.
    """
    rows, cols = x.shape
    block_rows, block_cols = block
    whole_rows, whole_cols = rows // block_rows * block_rows, cols // block_cols * block_cols
    regions = []
    for r0, r1, height in ((0, whole_rows, block_rows), (whole_rows, rows, rows - whole_rows)):
        for c0, c1, width in ((0, whole_cols, block_cols), (whole_cols, cols, cols - whole_cols)):
            if r1 > r0 and c1 > c0:
                part = x[r0:r1, c0:c1].view((r1 - r0) // height, height, (c1 - c0) // width, width)
                regions.append((part, r0 // block_rows, c0 // block_cols))
    return regions


def quantize_blocks(
    x: torch.Tensor, fmt: BlockFloat8, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    """Quantizes `x` (R, C) into `codes` (R, C, fmt.dtype) and block `scales` (float32).

    `scales` is (row blocks, col blocks); a block's scale is absmax / fmt.max_value (1 for an
    all-zero block), a code clamp(x / scale) rounded to the format.

    Example:
        >>> fmt = BlockFloat8(block=(2, 2))
        >>> codes, scales = torch.empty(2, 3, dtype=fmt.dtype), torch.empty(1, 2)
        >>> x = torch.tensor([[1.0, -4.0, 0.0], [2.0, 0.5, 0.0]])
        >>> quantize_blocks(x, fmt, codes, scales)
        >>> (scales * fmt.max_value).tolist()
        [[4.0, 448.0]]
    """
    top = fmt.max_value
    for (part, rb, cb), (out, _, _) in zip(
        _regions(x, fmt.block), _regions(codes, fmt.block), strict=True
    ):
        values = part.float()
        amax = torch.amax(values.abs(), dim=(1, 3))
        scale = torch.where(amax > 0, amax / top, 1.0)
        scales[rb : rb + scale.shape[0], cb : cb + scale.shape[1]] = scale
        # One temporary: divided, clamped in place, cast by the copy (as `.to` rounds).
        out.copy_(torch.div(values, scale[:, None, :, None]).clamp_(-top, top))


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFloat8, out: torch.Tensor
) -> None:
    """Writes `codes` (R, C) times their block `scales` into `out` (R, C, any float dtype)."""
    for (part, rb, cb), (target, _, _) in zip(
        _regions(codes, fmt.block), _regions(out, fmt.block), strict=True
    ):
        grid = scales[rb : rb + part.shape[0], cb : cb + part.shape[2]]
        target.copy_(part.float().mul_(grid[:, None, :, None]))


@dataclass(frozen=True)
class _Piece:
    """One tensor's rows held by one rank, and where their scales go."""

    name: str
    lo: int  # in the rank's shard
    hi: int
    rows: int
    cols: int
    scale_start: int  # in the rank's scale segment
    grid: tuple[int, int]  # (row blocks, col blocks)


class Float8Wire:
    """One DBuffer's fp8 all-gather: the plan of codes and scales, made once.

    Args:
        fmt: The wire format.
        layout: The buffer's layout.
        shapes: Each tensor's shape.
        rank: This rank's index on the shard axis.

    Raises:
        ValueError: a tensor with fewer than 2 dims, or one whose shards could cut a block
            (the planner's unit is not whole blocks of rows), naming the tensor.
    """

    def __init__(
        self, fmt: BlockFloat8, layout: Layout, shapes: Mapping[str, torch.Size], rank: int
    ) -> None:
        self.fmt, self._layout = fmt, layout
        self._shapes = {name: shape for name, shape in shapes.items() if shape.numel()}
        block_rows = fmt.block[0]
        for name, shape in self._shapes.items():
            if len(shape) < 2:
                raise ValueError(
                    f"BlockFloat8 gathers tensors of 2 or more dims; {name!r} has shape "
                    f"{tuple(shape)}: gather it in the compute dtype (another group or buffer)"
                )
            unit = layout.unit(name)
            if unit % (block_rows * shape[-1]):
                raise ValueError(
                    f"BlockFloat8 block rows {block_rows} of {name!r} (shape {tuple(shape)}) "
                    f"could be cut by a shard boundary: shards cut every {unit // shape[-1]} "
                    f"rows; use block_rows a multiple of {block_rows} (and a row count that "
                    f"is one)"
                )
        pieces = [self._plan_rank(r) for r in range(layout.world_size)]
        self.num_scales = max(
            (p[-1].scale_start + math.prod(p[-1].grid) for p in pieces if p), default=0
        )
        self._mine = pieces[rank]
        # Per tensor, where its full scale grid lies in the gathered scales (rank by rank,
        # whose rows follow each other): one index gathers it.
        index: dict[str, list[int]] = {name: [] for name in self._shapes}
        for r, rank_pieces in enumerate(pieces):
            for piece in rank_pieces:
                start = r * self.num_scales + piece.scale_start
                index[piece.name].extend(range(start, start + math.prod(piece.grid)))
        self._index = {name: torch.tensor(ids, dtype=torch.long) for name, ids in index.items()}
        self._on_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _plan_rank(self, rank: int) -> list[_Piece]:
        ranges = [(*self._layout.local_range(name, rank), name) for name in self._shapes]
        pieces, start = [], 0
        for lo, hi, name in sorted(r for r in ranges if r[1] > r[0]):
            cols = self._shapes[name][-1]
            rows = (hi - lo) // cols
            grid = (-(-rows // self.fmt.block[0]), -(-cols // self.fmt.block[1]))
            pieces.append(_Piece(name, lo, hi, rows, cols, start, grid))
            start += math.prod(grid)
        return pieces

    def _indices(self, device: torch.device) -> dict[str, torch.Tensor]:
        found = self._on_device.get(device)
        if found is None:
            found = self._on_device[device] = {n: i.to(device) for n, i in self._index.items()}
        return found

    def gather(
        self, local: torch.Tensor, out: torch.Tensor, comm: ShardComm, *, async_op: bool
    ) -> tuple[Works, Callable[[], None]]:
        """Quantizes this rank's shard and all-gathers codes and scales.

        Args:
            local: This rank's shard (S elements).
            out: The global buffer (W * S elements, the compute dtype) to dequantize into.
            comm: The shard axis's comm object.
            async_op: Return before the collectives complete.

        Returns:
            The works, and the dequantize pass to run once they are done.
        """
        size = local.numel()
        wire = torch.empty(comm.size * size, dtype=torch.uint8, device=local.device)
        scales = torch.empty(comm.size * self.num_scales, dtype=torch.float32, device=local.device)
        codes, my_scales = comm.chunk(wire), comm.chunk(scales)
        typed = codes.view(self.fmt.dtype)
        for p in self._mine:
            count = math.prod(p.grid)
            quantize_blocks(
                local[p.lo : p.hi].view(p.rows, p.cols),
                self.fmt,
                typed[p.lo : p.hi].view(p.rows, p.cols),
                my_scales[p.scale_start : p.scale_start + count].view(p.grid),
            )
        works = comm.all_gather(wire, codes, async_op=async_op)
        works += comm.all_gather(scales, my_scales, async_op=async_op)

        def dequantize() -> None:
            gathered = wire.view(self.fmt.dtype)
            block_rows, block_cols = self.fmt.block
            indices = self._indices(scales.device)
            for name, shape in self._shapes.items():
                start, cols = self._layout.offsets[name], shape[-1]
                rows = shape.numel() // cols
                grid = scales[indices[name]].view(-(-rows // block_rows), -(-cols // block_cols))
                dequantize_blocks(
                    gathered[start : start + rows * cols].view(rows, cols),
                    grid,
                    self.fmt,
                    out[start : start + rows * cols].view(rows, cols),
                )

        return works, dequantize
