"""RaggedShard as a value: validation and flat-range math (single process)."""

import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ragged_placement import RaggedShard


def test_value_semantics() -> None:
    a = RaggedShard((0,), (1, 2, 0))
    assert a == RaggedShard([0], [1, 2, 0]) and hash(a) == hash(RaggedShard((0,), (1, 2, 0)))
    assert a != RaggedShard((0,), (1, 2, 1)) and a != RaggedShard((0, 1), (1, 2, 0))
    assert repr(a) == "RaggedShard(dims=(0,), local_units=(1, 2, 0))"
    assert pickle.loads(pickle.dumps(a)) == a
    assert not (a.is_shard() or a.is_replicate() or a.is_partial())
    with pytest.raises(AttributeError, match="immutable"):
        a.local_units = (1,)


@pytest.mark.parametrize(
    ("dims", "units", "error", "match"),
    [
        ((1,), (1, 1), ValueError, r"prefix \(0, 1, ..., k-1\).*got \(1,\)"),
        ((), (1, 1), ValueError, "non-empty prefix"),
        ((0,), (), ValueError, "one entry per rank"),
        ((0,), (1, -1), ValueError, r"must be >= 0, got \(1, -1\)"),
        ((0,), (0, 0), ValueError, r"must not be all zero, got \(0, 0\)"),
        ((0,), (1.0, 1), TypeError, "must hold ints"),
        (0, (1,), TypeError, "tuple of ints"),
    ],
)
def test_rejects_bad_values(dims, units, error, match) -> None:
    with pytest.raises(error, match=match):
        RaggedShard(dims, units)


def test_units_must_be_whole_rows() -> None:
    with pytest.raises(ValueError, match="whole rows of 3 elements"):
        RaggedShard((0,), (1, 1)).flat_ranges((3, 3), 2)
    with pytest.raises(ValueError, match="has 2 local_units but the mesh axis has 3"):
        RaggedShard((0,), (1, 1)).flat_ranges((4, 3), 3)
    assert RaggedShard((0, 1), (1, 1)).flat_ranges((1, 4, 3), 2) == ((0, 6), (6, 12))


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=8).filter(any),
    st.integers(0, 4),
    st.integers(1, 4),
)
def test_flat_ranges_tile_the_tensor(units, rows_per_unit, row) -> None:
    placement = RaggedShard((0,), tuple(units))
    shape = (sum(units) * rows_per_unit, row)
    ranges = placement.flat_ranges(shape, len(units))
    assert ranges[0][0] == 0 and ranges[-1][1] == shape[0] * row
    for (a0, a1), (b0, _), u in zip(ranges, (*ranges[1:], (ranges[-1][1], 0)), units, strict=True):
        assert a1 == b0 and a1 - a0 == u * rows_per_unit * row


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=8).filter(any),
    st.integers(1, 3),
    st.integers(1, 4),
    st.data(),
)
def test_reference_ranges_are_the_reference_rows_cut_off(units, rows_per_unit, row, data) -> None:
    # An uneven split on another axis: a block with fewer rows (and maybe shorter ones) than
    # the reference holds each rank's reference rows, cut off at its last row.
    placement = RaggedShard((0,), tuple(units))
    reference = (sum(units) * rows_per_unit, row)
    rows = data.draw(st.integers(0, reference[0]))
    own_row = data.draw(st.integers(0, row))
    got = placement.flat_ranges((rows, own_row), len(units), reference=reference)
    ref_rows = [(lo // row, hi // row) for lo, hi in placement.flat_ranges(reference, len(units))]
    expected = [(min(lo, rows) * own_row, min(hi, rows) * own_row) for lo, hi in ref_rows]
    assert list(got) == expected
    assert got[-1][1] == rows * own_row  # the pieces tile the block
    with pytest.raises(ValueError, match="cannot count the rows"):
        placement.flat_ranges((reference[0] + 1, row), len(units), reference=reference)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_checkpoint_boxes_tile_a_flat_range_in_order(shape, data) -> None:
    import math

    from ragged_placement._checkpoint import flat_range_boxes

    numel = math.prod(shape)
    lo = data.draw(st.integers(0, numel))
    hi = data.draw(st.integers(lo, numel))
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    cursor = lo
    for offsets, sizes in flat_range_boxes(lo, hi, shape):
        # Each box is a contiguous run of the flat range, starting where the last one ended.
        start = sum(o * s for o, s in zip(offsets, strides, strict=True))
        assert start == cursor
        assert all(o + n <= d for o, n, d in zip(offsets, sizes, shape, strict=True))
        assert all(n == d for n, d in zip(sizes[1:], shape[1:], strict=True)) or sizes[0] == 1
        cursor += math.prod(sizes)
    assert cursor == hi


def test_strided_value_semantics_and_rows() -> None:
    from ragged_placement import StridedRaggedShard

    s = StridedRaggedShard((0,), (3, 1), split_factor=2)
    assert s == StridedRaggedShard([0], [3, 1], 2) and s != StridedRaggedShard((0,), (3, 1), 1)
    assert s != RaggedShard((0,), (3, 1)) and hash(s) != hash(RaggedShard((0,), (3, 1)))
    assert pickle.loads(pickle.dumps(s)) == s
    assert repr(s) == "StridedRaggedShard(dims=(0,), local_units=(3, 1), split_factor=2)"
    assert s.piece_rows((8, 5), 2) == ((0, 6), (6, 8))
    assert [s.chunk_rows((8, 5), 2, 0, t) for t in (0, 1)] == [(0, 3), (3, 6)]
    with pytest.raises(ValueError, match=r"dims must be \(0,\)"):
        StridedRaggedShard((0, 1), (1, 1), 2)
    with pytest.raises(ValueError, match="split_factor must be an int >= 1, got 0"):
        StridedRaggedShard((0,), (1, 1), 0)


def test_chunk_range_rejects_bad_input() -> None:
    import pytest

    from ragged_placement import chunk_range

    assert [chunk_range(0, 2, i) for i in range(2)] == [(0, 0), (0, 0)]
    for size, parts, index in ((-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)):
        with pytest.raises(ValueError, match="chunk_range needs"):
            chunk_range(size, parts, index)


@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    rows=st.integers(1, 6),
)
def test_cut_dims_for_is_the_fewest_dims_whose_rows_tile_a_unit(shape, rows) -> None:
    from ragged_placement import cut_dims_for

    # A unit of `rows` rows of the trailing k dims is whole rows of those dims, and of no
    # fewer dims unless their rows divide it too.
    for k in range(1, len(shape) + 1):
        unit = rows * math.prod(shape[k:])
        cut = cut_dims_for(tuple(shape), unit)
        assert len(cut) <= k and cut == tuple(range(len(cut)))
        assert unit % math.prod(shape[len(cut) :]) == 0
        if len(cut) > 1:
            assert unit % math.prod(shape[len(cut) - 1 :]) != 0


def test_cut_dims_for_rejects_bad_input_and_takes_empty_tensors() -> None:
    from ragged_placement import cut_dims_for

    assert cut_dims_for((3, 0), 0) == (0,)
    for shape, unit in [((2, -1), 2), ((2, 3), -1), ((2, 3), 1.5), ((2, 3), True)]:
        with pytest.raises(ValueError, match="cut_dims_for"):
            cut_dims_for(shape, unit)  # type: ignore[arg-type]
