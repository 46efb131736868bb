"""Which rank orthogonalizes which matrix: longest-processing-time-first on Newton-Schulz FLOPs.

Every rank builds the same plan from shapes and shard ranges alone (no communication): the
matrices are taken from the most to the least expensive (ties in their given order) and each
goes to the least loaded rank; among equally loaded ranks, to the one already holding the
largest piece of it (less to send), then the lowest rank. This is Graham's LPT rule, whose
makespan is at most (4/3 - 1/(3W)) times the optimum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def ns_flops(shape: Sequence[int], ns_steps: int) -> int:
    """FLOPs of `ns_steps` Newton-Schulz steps on a matrix or a stack of matrices.

    Per step and matrix with short side s and long side l: X X^T (2 s^2 l), the quintic's
    A @ A (2 s^3) and the product with X (2 s^2 l).

    Example:
        >>> ns_flops((4, 8), 5)  # s = 4, l = 8
        3200
    """
    *batch, rows, cols = shape
    s, long = min(rows, cols), max(rows, cols)
    return math.prod(batch) * ns_steps * (4 * s * s * long + 2 * s**3)


@dataclass(frozen=True)
class MatrixAssignment:
    """One matrix's owner and what orthogonalizing it there costs.

    Attributes:
        index: Position in the optimizer's list of sharded Muon matrices.
        name: The parameter's name (its FQN when the optimizer was given names).
        shape: The global shape.
        owner: The rank (on the shard axis) that gathers and orthogonalizes it.
        flops: Newton-Schulz FLOPs per step.
        elements_in: Elements sent to the owner per step (those it does not hold).
        elements_out: Elements of the update sent back per step (the same count).
    """

    index: int
    name: str
    shape: tuple[int, ...]
    owner: int
    flops: int
    elements_in: int
    elements_out: int

    def __post_init__(self) -> None:
        if self.owner < 0 or self.flops < 0 or self.elements_in < 0:
            raise ValueError(f"invalid assignment {self}")


def plan_owners(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    pieces: Sequence[Sequence[int]],
    num_ranks: int,
    ns_steps: int,
) -> tuple[MatrixAssignment, ...]:
    """Assigns each matrix to one rank by LPT on Newton-Schulz FLOPs.

    Args:
        names: One name per matrix (for the plan's readers; ties use the order given).
        shapes: Global shape of each matrix (2-D, or 3-D for a stack).
        pieces: Elements each rank holds of each matrix (`num_ranks` entries per matrix).
        num_ranks: Ranks on the shard axis.
        ns_steps: Newton-Schulz steps, for the FLOPs.

    Returns:
        One MatrixAssignment per matrix, in the given order.

    Example:
        >>> plan = plan_owners(["a", "b", "c"], [(8, 8), (4, 4), (4, 4)],
        ...                    [(32, 32), (16, 0), (0, 16)], 2, 5)
        >>> [a.owner for a in plan], [a.elements_in for a in plan]
        ([0, 1, 1], [32, 16, 0])
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if not len(names) == len(shapes) == len(pieces):
        raise ValueError("names, shapes and pieces must have one entry per matrix")
    for name, held in zip(names, pieces, strict=True):
        if len(held) != num_ranks:
            raise ValueError(f"{name}: {len(held)} piece sizes for {num_ranks} ranks")
    flops = [ns_flops(shape, ns_steps) for shape in shapes]
    order = sorted(range(len(names)), key=lambda i: (-flops[i], i))
    loads = [0] * num_ranks
    owners = [0] * len(names)
    for i in order:
        least = min(loads)
        owner = max(
            (r for r in range(num_ranks) if loads[r] == least),
            key=lambda r: (pieces[i][r], -r),
        )
        owners[i] = owner
        loads[owner] += flops[i]
    out = []
    for i, name in enumerate(names):
        moved = sum(pieces[i]) - pieces[i][owners[i]]
        out.append(MatrixAssignment(i, name, tuple(shapes[i]), owners[i], flops[i], moved, moved))
    return tuple(out)


def makespan(plan: Sequence[MatrixAssignment], num_ranks: int) -> int:
    """The largest per-rank sum of FLOPs.

    Example:
        >>> makespan(plan_owners(["a", "b"], [(4, 4), (4, 4)], [(16,), (16,)], 1, 1), 1)
        768
    """
    loads = [0] * num_ranks
    for a in plan:
        loads[a.owner] += a.flops
    return max(loads)
