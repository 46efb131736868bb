import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shard_planner import (
    Layout,
    LayoutError,
    TensorSpec,
    fsdp2_padding,
    fsdp2_whole_block_padding,
    plan_layout,
)


def test_from_shape_blocks_are_rows_of_the_trailing_dims() -> None:
    assert TensorSpec.from_shape("w", (4096, 1024), block_rows=32).block == 32 * 1024
    assert TensorSpec.from_shape("b", (1024,), block_rows=32).block == 32
    assert TensorSpec.from_shape("s", ()).numel == 1
    fused = TensorSpec.from_shape("e", (128, 2880, 5760), block_rows=16, num_shard_dims=2)
    assert (fused.block, fused.shape) == (16 * 5760, (128, 2880, 5760))
    assert TensorSpec.from_shape("e", (128, 2880, 5760)).block == 2880 * 5760


def test_unit_and_atom() -> None:
    spec = TensorSpec("w", 1009 * 64, block=32 * 64)
    assert spec.unit == 64 and spec.atom == 32 * 64
    small = TensorSpec("n", 20, block=32)
    assert small.atom == 20 and small.unit == 4
    assert TensorSpec("z", 0, block=8).atom == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("", 4), {}, ValueError, "non-empty str"),
        (("a", -1), {}, ValueError, r"numel must be >= 0, got -1"),
        (("a", 4, 0), {}, ValueError, r"block must be >= 1, got 0"),
        (("a", 4.0), {}, TypeError, "numel must be an int, got float"),
        (("a", 4), {"shape": (3,)}, ValueError, r"shape \(3,\) has 3 elements but numel is 4"),
    ],
)
def test_spec_rejects_bad_values(args, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        TensorSpec(*args, **kwargs)


def test_from_shape_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="block_rows of 'w' must be >= 1, got 0"):
        TensorSpec.from_shape("w", (4, 4), block_rows=0)
    with pytest.raises(ValueError, match=r"num_shard_dims of 'w' must be in \[1, 2\].*got 3"):
        TensorSpec.from_shape("w", (4, 4), num_shard_dims=3)
    with pytest.raises(ValueError, match="shape entry must be >= 0, got -4"):
        TensorSpec.from_shape("w", (-4, 4))


def _layout() -> Layout:
    specs = [
        TensorSpec.from_shape("wq", (64, 32), block_rows=4),
        TensorSpec.from_shape("norm", (32,)),
        TensorSpec("odd", 77, block=7),
    ]
    return plan_layout(specs, world_size=3, align=4)


def test_queries_agree_with_offsets() -> None:
    layout = _layout()
    for spec in layout.tensors:
        start = layout.offsets[spec.name]
        covered = 0
        for rank in range(layout.world_size):
            lo, hi = layout.local_range(spec.name, rank)
            covered += hi - lo
            if hi > lo:
                assert rank * layout.shard_size + lo >= start
                assert rank * layout.shard_size + hi <= start + spec.numel
        assert covered == spec.numel
    assert layout.padding == layout.buffer_numel - layout.total_numel
    assert layout.padding_ratio == layout.padding / layout.total_numel


def test_json_round_trip() -> None:
    layout = _layout()
    again = Layout.from_json(layout.to_json())
    assert again == layout
    assert again.offsets == layout.offsets
    assert again.tensors[0].shape == (64, 32)
    # Each tensor's per-rank units travel with it (RaggedShard's local_units), checked on read.
    data = json.loads(layout.to_json())
    for entry in data["tensors"]:
        assert tuple(entry["local_units"]) == layout.local_units(entry["name"])
    data["tensors"][0]["local_units"][0] += 1
    with pytest.raises(ValueError, match=r"has local_units .* but its offset gives"):
        Layout.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(shard_size=d["shard_size"] + 1), "not a multiple of align"),
        (lambda d: d["tensors"][1].update(offset=d["tensors"][0]["offset"] + 1), "overlaps"),
        (lambda d: d["tensors"][2].update(offset=10**9), "outside the buffer"),
    ],
)
def test_from_json_rejects_broken_layouts(mutate, match) -> None:
    data = json.loads(_layout().to_json())
    mutate(data)
    with pytest.raises(LayoutError, match=match):
        Layout.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{nope", "does not parse"),
        ("[]", "must be an object with version 1"),
        ('{"version": 1, "tensors": []}', "missing or mistypes a field"),
        (
            '{"version": 1, "world_size": 0, "shard_size": 4, "align": 1, "tensors": []}',
            "world_size must be >= 1",
        ),
    ],
)
def test_from_json_rejects_bad_text(text, match) -> None:
    with pytest.raises(ValueError, match=match):
        Layout.from_json(text)


def test_cut_block_is_reported_with_tensor_and_boundary() -> None:
    spec = TensorSpec("w", 12, block=4)
    with pytest.raises(LayoutError, match=r"rank boundary 6 \(rank 1\) cuts a block of tensor 'w'"):
        Layout(2, 6, (spec,), (0,)).validate()


def test_layout_queries_reject_bad_names_and_ranks() -> None:
    layout = _layout()
    with pytest.raises(
        KeyError, match="no tensor named 'missing' in this layout; valid: norm, odd, wq"
    ):
        layout.local_units("missing")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        layout.local_range("wq", 3)


def test_numpy_style_integers_are_accepted() -> None:
    class Int64:  # what numpy.int64 offers: __index__, not an int subclass
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    spec = TensorSpec.from_shape("w", (Int64(8), Int64(4)), block_rows=Int64(2))
    assert (spec.numel, spec.block, spec.shape) == (32, 8, (8, 4))
    assert type(spec.numel) is int
    layout = plan_layout([spec], world_size=Int64(2))
    assert layout.world_size == 2 and type(layout.world_size) is int


def test_a_hand_built_layout_is_validated() -> None:
    spec = TensorSpec("w", 8, block=4)
    with pytest.raises(LayoutError, match="cuts a block of tensor 'w'"):
        Layout(world_size=4, shard_size=2, tensors=(spec,), starts=(0,))
    with pytest.raises(TypeError, match="must be TensorSpecs"):
        Layout(world_size=1, shard_size=8, tensors=("w",), starts=(0,))  # type: ignore[arg-type]


def test_local_rows_names_the_rows_each_rank_holds() -> None:
    layout = plan_layout([TensorSpec.from_shape("w", (1009, 64), block_rows=32)], world_size=4)
    rows = [layout.local_rows("w", rank) for rank in range(4)]
    assert rows[0][0] == 0 and rows[-1][1] == 1009
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    assert all(start % 32 == 0 for start, _ in rows)
    cut = plan_layout([TensorSpec("v", 10)], world_size=3)
    with pytest.raises(ValueError, match="has no shape"):
        cut.local_rows("v", 0)


def test_plan_helpers_reject_the_wrong_types() -> None:
    from shard_planner import dump_plan, explain_padding, load_plan

    with pytest.raises(TypeError, match="mapping of group name to Layout"):
        dump_plan({"g": "not a layout"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="takes the JSON text, got bytes"):
        load_plan(b"{}")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a Layout, got dict"):
        explain_padding({})  # type: ignore[arg-type]


@given(
    shapes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 17)), min_size=1, max_size=6),
    block_rows=st.integers(1, 40),
    world=st.integers(1, 70),
)
def test_fsdp2_keeping_blocks_whole_pads_each_tensor_to_whole_blocks_per_rank(
    shapes, block_rows, world
) -> None:
    specs = [TensorSpec.from_shape(f"t{i}", s, block_rows) for i, s in enumerate(shapes)]
    padding = fsdp2_whole_block_padding(specs, world)
    # Every tensor padded to a multiple of W blocks: each rank's even chunk is whole blocks.
    expected = 0
    for (rows, cols), spec in zip(shapes, specs, strict=True):
        blocks = -(-rows * cols // spec.atom)
        padded = -(-blocks // world) * world * spec.atom
        assert padded % (world * spec.atom) == 0 and padded >= rows * cols
        assert padded - rows * cols < world * spec.atom  # the least such padding
        expected += padded - rows * cols
    assert padding == expected
    # One-row blocks: FSDP2's own Shard(0) padding.
    rows_whole = [TensorSpec.from_shape(f"t{i}", s) for i, s in enumerate(shapes)]
    assert fsdp2_whole_block_padding(rows_whole, world) == fsdp2_padding(rows_whole, world)
