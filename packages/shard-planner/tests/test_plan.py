import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_checker import exact_shard_size, violations

from shard_planner import LayoutError, TensorSpec, lower_bound, plan_layout
from shard_planner._plan import FIT_MIN_GAIN

# -- random instances -------------------------------------------------------------------------

numels = st.one_of(
    st.just(0),
    st.integers(1, 64),
    st.integers(65, 20_000),
    st.integers(20_001, 2_000_000),
)
blocks = st.one_of(st.just(1), st.integers(2, 64), st.sampled_from([128, 1000, 4096, 32 * 4096]))


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[TensorSpec], int, int]:
    n = draw(st.integers(1, 14))
    specs = [TensorSpec(f"t{i}", draw(numels), draw(blocks)) for i in range(n)]
    world = draw(st.one_of(st.integers(1, 8), st.integers(9, 10240)))
    align = draw(st.integers(1, 64))
    return specs, world, align


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["auto", "given", "block", "size", "fit"]))
def test_every_plan_meets_all_constraints(instance, order) -> None:
    specs, world, align = instance
    layout = plan_layout(specs, world, align=align, order=order)
    assert violations(specs, layout.starts, layout.shard_size, world, align) == []
    layout.validate()  # agrees with the independent checker
    assert layout.shard_size >= layout.lower_bound == lower_bound(specs, world, align=align)
    for spec in specs:
        units = layout.local_units(spec.name)
        assert len(units) == world
        assert sum(units) * spec.unit == spec.numel
        pieces = [layout.local_range(spec.name, r) for r in range(world)] if world <= 64 else []
        assert all(hi - lo == u * spec.unit for (lo, hi), u in zip(pieces, units, strict=False))


@settings(max_examples=300, deadline=None)
@given(instances())
def test_validate_catches_a_moved_tensor(instance) -> None:
    specs, world, align = instance
    layout = plan_layout(specs, world, align=align)
    for i in range(len(specs)):
        starts = list(layout.starts)
        starts[i] += 1
        expected = violations(specs, starts, layout.shard_size, world, align)
        # A hand-built layout is validated on construction.
        if expected:
            with pytest.raises(LayoutError):
                type(layout)(world, layout.shard_size, layout.tensors, tuple(starts), align)
        else:
            type(layout)(world, layout.shard_size, layout.tensors, tuple(starts), align).validate()


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.integers(0, 10**6), min_size=1, max_size=30),
    st.integers(1, 10240),
    st.integers(1, 64),
)
def test_element_granularity_pads_at_most_world_times_align(sizes, world, align) -> None:
    specs = [TensorSpec(f"t{i}", n) for i, n in enumerate(sizes)]
    layout = plan_layout(specs, world, align=align)
    assert layout.padding < world * align
    assert layout.shard_size == layout.lower_bound


# -- exactness against a brute-force solver ----------------------------------------------------


def _tiny_instance(rng: random.Random) -> tuple[list[TensorSpec], int, int]:
    n = rng.randint(1, 6)
    specs = [
        TensorSpec(f"t{i}", rng.randint(1, 14), rng.choice([1, 2, 3, 4, 5, 6, 8])) for i in range(n)
    ]
    return specs, rng.randint(1, 4), rng.choice([1, 1, 2, 3])


def test_quality_against_the_optimum_on_tiny_instances() -> None:
    rng = random.Random(20261129)
    ratios = []
    for _ in range(400):
        specs, world, align = _tiny_instance(rng)
        optimum = exact_shard_size(specs, world, align)
        ours = plan_layout(specs, world, align=align).shard_size
        assert ours >= optimum, "the exact solver must never be beaten"
        assert ours >= lower_bound(specs, world, align=align)
        assert optimum >= lower_bound(specs, world, align=align), "the bound must hold"
        ratios.append(ours / optimum)
    mean = sum(ratios) / len(ratios)
    print(
        f"\nheuristic/optimum over {len(ratios)} instances: mean {mean:.4f}, max {max(ratios):.4f},"
        f" optimal in {sum(r == 1 for r in ratios)}"
    )
    assert max(ratios) <= 2.0
    assert mean <= 1.05


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_never_worse_than_twice_the_optimum(rng) -> None:
    specs, world, align = _tiny_instance(rng)
    assert plan_layout(specs, world, align=align).shard_size <= 2 * exact_shard_size(
        specs, world, align
    )


# -- specific layouts --------------------------------------------------------------------------


def test_partial_last_block_is_never_cut() -> None:
    spec = TensorSpec.from_shape("w", (1009, 64), block_rows=32)
    layout = plan_layout([spec], world_size=4)
    # 1009 rows in 32-row blocks: S is a multiple of 32 rows (the tensor holds whole shards),
    # and the unit is one row since gcd(32, 1009) = 1.
    assert spec.unit == math.gcd(32 * 64, 1009 * 64) == 64
    assert layout.local_units("w") == (256, 256, 256, 241)
    assert sum(layout.local_units("w")) * spec.unit == spec.numel


def test_one_hot_and_empty_ranks() -> None:
    # A tensor that is one block lands on a single rank; others may hold nothing of it.
    specs = [TensorSpec("big", 100, block=100), TensorSpec("small", 10, block=10)]
    layout = plan_layout(specs, world_size=3)
    assert layout.shard_size == 100
    assert sorted(layout.local_units("big")) == [0, 0, 1]
    assert sorted(layout.local_units("small")) == [0, 0, 1]
    assert layout.local_range("small", layout.local_units("small").index(0)) == (0, 0)


def test_world_size_one_is_one_shard() -> None:
    specs = [TensorSpec("a", 7, block=7), TensorSpec("b", 5, block=2)]
    layout = plan_layout(specs, world_size=1, align=4)
    assert layout.shard_size == 12 and layout.padding == 0
    assert layout.local_units("a") == (1,)


def test_tensor_containing_whole_shards_forces_divisibility() -> None:
    # 4 shards inside one tensor: S must be a multiple of its block (3), and >= 25.
    layout = plan_layout([TensorSpec("w", 100, block=3)], world_size=4)
    assert layout.shard_size % 3 == 0 and layout.shard_size == 27 == layout.lower_bound


def test_empty_group_and_zero_sized_tensors() -> None:
    layout = plan_layout([TensorSpec("z", 0)], world_size=4)
    assert (layout.shard_size, layout.padding, layout.local_units("z")) == (0, 0, (0, 0, 0, 0))
    layout = plan_layout([TensorSpec("z", 0), TensorSpec("a", 8)], world_size=4, align=2)
    assert layout.shard_size == 2 and layout.local_units("z") == (0, 0, 0, 0)
    assert plan_layout([], world_size=3).shard_size == 0


def test_order_given_keeps_model_order() -> None:
    specs = [TensorSpec(f"t{i}", n, b) for i, (n, b) in enumerate([(30, 1), (500, 50), (7, 7)])]
    layout = plan_layout(specs, world_size=4, order="given")
    assert list(layout.starts) == sorted(layout.starts)


def test_auto_is_never_worse_than_any_single_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        specs = [
            TensorSpec(f"t{i}", rng.randint(1, 5000), rng.choice([1, 7, 16, 96, 250]))
            for i in range(rng.randint(1, 20))
        ]
        world, align = rng.randint(1, 64), rng.choice([1, 4, 16])
        layout = plan_layout(specs, world, align=align)
        auto = layout.shard_size
        for order in ("given", "block", "size"):
            assert auto <= plan_layout(specs, world, align=align, order=order).shard_size
        # "fit" is skipped when the fixed orders are within FIT_MIN_GAIN of the floor.
        fit = plan_layout(specs, world, align=align, order="fit").shard_size
        above_floor = (auto - layout.lower_bound) * world
        assert auto <= fit or above_floor <= FIT_MIN_GAIN * layout.total_numel


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"world_size": 2.0}, TypeError, "world_size must be an int"),
        ({"world_size": True}, TypeError, "world_size must be an int"),
        ({"world_size": 2, "align": 0}, ValueError, "align must be >= 1, got 0"),
        ({"world_size": 2, "order": "random"}, ValueError, "order must be one of"),
    ],
)
def test_bad_arguments(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        plan_layout([TensorSpec("a", 4)], **kwargs)


def test_bad_specs() -> None:
    with pytest.raises(TypeError, match="specs must hold TensorSpec"):
        plan_layout([("a", 4)], world_size=2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"names must be unique.*'a'"):
        plan_layout([TensorSpec("a", 4), TensorSpec("a", 5)], world_size=2)


def test_lower_bound_rejects_a_zero_world_or_alignment() -> None:
    specs = [TensorSpec("w", 10)]
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        lower_bound(specs, 0)
    with pytest.raises(ValueError, match="align must be >= 1, got 0"):
        lower_bound(specs, 2, align=0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        lower_bound(specs, 2.0)  # type: ignore[arg-type]
