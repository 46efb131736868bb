"""TensorSpec: what the planner needs to know about one tensor."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field


def check_count(what: str, value: object, minimum: int) -> int:
    """`value` as a plain int >= `minimum`; any integer type (numpy's too) is accepted."""
    # bool is an int subclass; True as a size is always a bug in the caller.
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    count = operator.index(value)  # type: ignore[arg-type]
    if count < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {count}")
    return count


# Ranks in one mesh axis (or one job): 2**20, far above any machine built. A world size
# beyond it is a typo, and per-rank tables of its size would not fit in memory.
MAX_WORLD_SIZE = 2**20


def check_world_size(what: str, value: object) -> int:
    """`value` as a rank count in [1, MAX_WORLD_SIZE]."""
    count = check_count(what, value, 1)
    if count > MAX_WORLD_SIZE:
        raise ValueError(f"{what} must be at most {MAX_WORLD_SIZE:,} ranks, got {count:,}")
    return count


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a group: its name, element count and unshardable block size.

    A block is `block` consecutive elements counted from the tensor's start; no shard boundary
    may fall inside a block. The last block may be partial (1009 rows in blocks of 32 rows),
    and a tensor smaller than its block is a single block.

    Attributes:
        name: Unique name inside the group (e.g. the parameter's FQN).
        numel: Number of elements, >= 0.
        block: Elements per unshardable block, >= 1 (1 = element granularity).
        shape: The tensor's shape, when known; baselines that shard by rows (FSDP2) need it.

    Example:
        >>> TensorSpec("w", numel=1009 * 64, block=32 * 64).unit
        64
    """

    name: str
    numel: int
    block: int = 1
    shape: tuple[int, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        name: object = self.name  # callers may pass anything; check before trusting the hint
        if not isinstance(name, str) or not name:
            raise ValueError(f"TensorSpec.name must be a non-empty str, got {self.name!r}")
        numel = check_count(f"TensorSpec({self.name!r}).numel", self.numel, 0)
        object.__setattr__(self, "numel", numel)
        block = check_count(f"TensorSpec({self.name!r}).block", self.block, 1)
        object.__setattr__(self, "block", block)
        if self.shape is not None:
            shape = tuple(
                check_count(f"TensorSpec({self.name!r}).shape entry", size, 0)
                for size in self.shape
            )
            if math.prod(shape) != self.numel:
                raise ValueError(
                    f"TensorSpec({self.name!r}): shape {shape} has {math.prod(shape)} elements "
                    f"but numel is {self.numel}"
                )
            object.__setattr__(self, "shape", shape)

    @classmethod
    def from_shape(
        cls,
        name: str,
        shape: Sequence[int],
        block_rows: int = 1,
        *,
        num_shard_dims: int = 1,
    ) -> TensorSpec:
        """Builds a spec whose block is `block_rows` rows of the tensor.

        A row is one index of the leading `num_shard_dims` dims, i.e. `shape[num_shard_dims:]`
        elements; this matches `RaggedShard(dims=(0, ..., num_shard_dims - 1))`. For a fused
        expert tensor of shape (E, H, F), `num_shard_dims=2` makes a row one matrix row (F
        elements) instead of one whole expert. For 1-D tensors a block is `block_rows` elements.

        Args:
            name: Tensor name.
            shape: Tensor shape; a 0-D tensor counts as one element.
            block_rows: Rows per unshardable block, >= 1.
            num_shard_dims: How many leading dims may be cut, in [1, max(ndim, 1)].

        Returns:
            The spec, with `shape` recorded.

        Example:
            >>> TensorSpec.from_shape("wq", (4096, 4096), block_rows=32).block
            131072
        """
        shape = tuple(check_count(f"TensorSpec({name!r}).shape entry", n, 0) for n in shape)
        block_rows = check_count(f"block_rows of {name!r}", block_rows, 1)
        num_shard_dims = check_count(f"num_shard_dims of {name!r}", num_shard_dims, 1)
        if num_shard_dims > max(len(shape), 1):
            raise ValueError(
                f"num_shard_dims of {name!r} must be in [1, {max(len(shape), 1)}] for shape "
                f"{shape}, got {num_shard_dims}"
            )
        row = math.prod(shape[num_shard_dims:])
        return cls(name, math.prod(shape), block_rows * row, shape=shape)

    @property
    def unit(self) -> int:
        """Elements per RaggedShard unit: gcd(block, numel), so every piece is whole units."""
        return math.gcd(self.block, self.numel)

    @property
    def atom(self) -> int:
        """The block the planner must keep whole: `block`, or the whole tensor if smaller."""
        return min(self.block, self.numel) if self.numel else 1
