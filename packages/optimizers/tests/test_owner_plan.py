"""The LPT owner plan: determinism, one owner each, Graham's bound against the optimum."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_optimizers import makespan, ns_flops, plan_owners

shapes_st = st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=1, max_size=7)


def _pieces(shapes, world, seed):
    out = []
    for i, (r, c) in enumerate(shapes):
        cuts = sorted((seed * 7 + i * 13 + k * 5) % (r + 1) for k in range(world - 1))
        rows = [b - a for a, b in zip([0, *cuts], [*cuts, r], strict=True)]
        out.append([n * c for n in rows])
    return out


def _optimum(flops, world):
    best = None
    for owners in itertools.product(range(world), repeat=len(flops)):
        loads = [0] * world
        for f, o in zip(flops, owners, strict=True):
            loads[o] += f
        best = max(loads) if best is None else min(best, max(loads))
    return best


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 4), seed=st.integers(0, 100))
def test_lpt_meets_grahams_bound_and_accounts_bytes(shapes, world, seed) -> None:
    pieces = _pieces(shapes, world, seed)
    names = [f"m{i}" for i in range(len(shapes))]
    plan = plan_owners(names, shapes, pieces, world, 5)
    assert plan == plan_owners(names, shapes, pieces, world, 5)  # deterministic
    assert [a.index for a in plan] == list(range(len(shapes)))
    assert all(0 <= a.owner < world for a in plan)
    for a, held in zip(plan, pieces, strict=True):
        assert a.flops == ns_flops(a.shape, 5)
        assert a.elements_in == a.elements_out == sum(held) - held[a.owner]
    opt = _optimum([a.flops for a in plan], world)
    assert makespan(plan, world) <= (4 / 3 - 1 / (3 * world)) * opt + 1e-9


def test_ties_go_to_the_rank_holding_the_largest_piece() -> None:
    # Four equal matrices on four ranks, each mostly held by a different rank.
    pieces = [[1, 2, 3, 10], [10, 1, 2, 3], [3, 10, 1, 2], [2, 3, 10, 1]]
    plan = plan_owners(list("abcd"), [(4, 4)] * 4, pieces, 4, 5)
    assert [a.owner for a in plan] == [3, 0, 1, 2]
    assert [a.elements_in for a in plan] == [6, 6, 6, 6]


def test_costlier_matrices_are_placed_first() -> None:
    plan = plan_owners(["small", "big"], [(4, 4), (64, 64)], [[16, 0], [0, 4096]], 2, 5)
    assert plan[1].owner == 1 and plan[0].owner == 0  # big first, to its holder; small to 0


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        plan_owners([], [], [], 0, 5)
    with pytest.raises(ValueError, match="2 piece sizes for 3 ranks"):
        plan_owners(["a"], [(2, 2)], [[2, 2]], 3, 5)


def test_owner_plan_totals_and_bad_input() -> None:
    from ragged_optimizers import MatrixAssignment, OwnerPlan

    # Slot 1 does "b" once; "a" is done by both replicas (slots 0 and 2) of a 2 x 2 mesh.
    a = MatrixAssignment(0, "a", (4, 4), 0, 100, 8, 8, num_copies=2)
    b = MatrixAssignment(1, "b", (4, 4), 1, 60, 8, 8)
    plan = OwnerPlan((a, b), 4)
    assert plan.loads == [100, 60, 100, 0] and plan.makespan == 100
    assert plan.lower_bound == 100  # the largest matrix; the even share is ceil(260 / 4) = 65
    assert list(plan) == [a, b] and plan[1] is b
    assert "1.000x the lower bound" in str(plan)
    with pytest.raises(
        ValueError, match=r"a is owned by slot 0 with 2 copies: it needs at least 2"
    ):
        OwnerPlan((a,), 1)
    with pytest.raises(ValueError, match=r"num_slots must be an int >= 0, got -1"):
        OwnerPlan((), -1)
    with pytest.raises(ValueError, match=r"initial_loads must be 2 FLOP counts"):
        plan_owners(["a"], [(4, 4)], [(16, 0)], 2, 5, initial_loads=[0, -1])
    # What a slot already has counts: the matrix goes to the idle slot, not the first.
    (placed,) = plan_owners(["a"], [(4, 4)], [(16, 0)], 2, 5, initial_loads=[10**6, 0])
    assert placed.owner == 1
