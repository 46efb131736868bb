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
from typing import Any


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
        owner: The slot that gathers and orthogonalizes it: the rank on the shard axis, or
            under HSDP / tensor parallelism a slot of the replicate (or tp) x shard ranks,
            replica (tp rank) owner // W, shard rank owner % W (see `Muon.owner_plan`).
        flops: Newton-Schulz FLOPs per step.
        elements_in: Elements sent to the owner per step (those it does not hold).
        elements_out: Elements of the update sent back per step (the same count).
        num_copies: How many replicas orthogonalize it (HSDP): 1 when it is done once in
            the whole mesh, at slot `owner` (replica owner // W, shard rank owner % W); R
            when each replica does it, at slots r * W + owner.
    """

    index: int
    name: str
    shape: tuple[int, ...]
    owner: int
    flops: int
    elements_in: int
    elements_out: int
    num_copies: int = 1

    def __post_init__(self) -> None:
        if self.owner < 0 or self.flops < 0 or self.elements_in < 0 or self.num_copies < 1:
            raise ValueError(f"invalid assignment {self}")

    def num_slots_needed(self) -> int:
        """The fewest slots a plan holding this assignment can have."""
        return (self.owner + 1) * self.num_copies

    def slots(self, num_slots: int) -> tuple[int, ...]:
        """The slots (ranks, or replicate x shard ranks) that orthogonalize this matrix.

        Example:
            >>> MatrixAssignment(0, "w", (4, 4), 1, 768, 8, 8, num_copies=2).slots(6)
            (1, 4)
        """
        if self.num_copies == 1:
            return (self.owner,)
        width = num_slots // self.num_copies
        return tuple(copy * width + self.owner for copy in range(self.num_copies))


def plan_owners(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    pieces: Sequence[Sequence[int]],
    num_ranks: int,
    ns_steps: int,
    initial_loads: Sequence[int] | None = None,
) -> tuple[MatrixAssignment, ...]:
    """Assigns each matrix to one rank by LPT on Newton-Schulz FLOPs.

    Args:
        names: One name per matrix (for the plan's readers; ties use the order given).
        shapes: Global shape of each matrix (2-D, or 3-D for a stack).
        pieces: Elements each rank holds of each matrix (`num_ranks` entries per matrix).
        num_ranks: Ranks on the shard axis.
        ns_steps: Newton-Schulz steps, for the FLOPs.
        initial_loads: FLOPs each rank already has to do (default none): the plan evens
            the totals.

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
    loads = [0] * num_ranks if initial_loads is None else list(initial_loads)
    given: list[object] = list(loads)  # user input: check what came
    if len(loads) != num_ranks or any(not isinstance(x, int) or x < 0 for x in given):
        raise ValueError(
            f"initial_loads must be {num_ranks} FLOP counts (ints >= 0), got {initial_loads!r}"
        )
    flops = [ns_flops(shape, ns_steps) for shape in shapes]
    order = sorted(range(len(names)), key=lambda i: (-flops[i], i))
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


def slot_loads(plan: Sequence[MatrixAssignment], num_slots: int) -> list[int]:
    """Newton-Schulz FLOPs per slot (rank, or replicate x shard rank under HSDP).

    Example:
        >>> slot_loads(plan_owners(["a", "b"], [(4, 4), (4, 4)], [(16, 0), (0, 16)], 2, 1), 2)
        [384, 384]
    """
    loads = [0] * num_slots
    for a in plan:
        for slot in a.slots(num_slots):
            loads[slot] += a.flops
    return loads


def makespan(plan: Sequence[MatrixAssignment], num_ranks: int) -> int:
    """The largest per-rank sum of FLOPs.

    Example:
        >>> makespan(plan_owners(["a", "b"], [(4, 4), (4, 4)], [(16,), (16,)], 1, 1), 1)
        768
    """
    return max(slot_loads(plan, num_ranks))


@dataclass(frozen=True)
class OwnerPlan(Sequence[MatrixAssignment]):
    """A Muon owner plan: one assignment per sharded matrix, and what it adds up to.

    A sequence of MatrixAssignment (index, iterate, len); printed, it states the makespan
    against its lower bound (the larger of an even share of the work and the largest matrix),
    the busiest slot and the elements moved.

    Example:
        >>> plan = OwnerPlan(plan_owners(["a", "b"], [(4, 4), (4, 4)], [(16, 0), (0, 16)], 2, 1), 2)
        >>> plan.makespan, plan.lower_bound, len(plan)
        (384, 384, 2)
    """

    assignments: tuple[MatrixAssignment, ...]
    num_slots: int

    def __post_init__(self) -> None:
        slots: object = self.num_slots  # user input: check what came
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {self.num_slots!r}")
        for a in self.assignments:
            if a.num_slots_needed() > self.num_slots:
                raise ValueError(
                    f"{a.name} is owned by slot {a.owner} with {a.num_copies} copies: it "
                    f"needs at least {a.num_slots_needed()} slots, got num_slots={slots}"
                )

    def __getitem__(self, index: Any) -> Any:
        return self.assignments[index]

    def __len__(self) -> int:
        return len(self.assignments)

    @property
    def loads(self) -> list[int]:
        """FLOPs per slot."""
        return slot_loads(self.assignments, self.num_slots) if self.num_slots else []

    @property
    def makespan(self) -> int:
        """FLOPs of the busiest slot: what bounds the step's Newton-Schulz time."""
        return max(self.loads, default=0)

    @property
    def lower_bound(self) -> int:
        """No assignment of these matrices to these slots has a smaller makespan."""
        if not self.assignments:
            return 0
        total = sum(a.flops * a.num_copies for a in self.assignments)
        largest = max(a.flops for a in self.assignments)
        return max(-(-total // self.num_slots), largest)

    def __str__(self) -> str:
        if not self.assignments:
            return "OwnerPlan: no sharded matrix"
        moved = sum(a.elements_in * a.num_copies for a in self.assignments)
        total = sum(a.flops * a.num_copies for a in self.assignments)
        return (
            f"OwnerPlan: {len(self)} matrices over {self.num_slots} slots, "
            f"{total / 1e9:.3g} GFLOP of Newton-Schulz per step; makespan "
            f"{self.makespan / 1e9:.3g} GFLOP = {self.makespan / self.lower_bound:.3f}x the "
            f"lower bound (busiest slot {self.loads.index(self.makespan)}); "
            f"{moved:,} elements to owners and back"
        )
