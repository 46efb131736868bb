import pytest

from shard_planner import GroupSpec, fsdp2_padding, load_preset, plan_layout, preset_names
from shard_planner._presets import parse_model

# Parameter counts from the models' published sizes (DeepSeek-V3 without its MTP module).
EXPECTED_PARAMS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    # As transformers 5 builds it: the routers' score corrections are buffers, not parameters
    # (58 MoE layers x 256).
    "deepseek-v3-671b": 671_026_419_200 - 58 * 256,
    "deepseek-v3-671b-per-expert": 671_026_419_200,
    "gpt-oss-120b": 116_829_156_672,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-30b-a3b-per-expert": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,  # the Hugging Face card's 235B, to the parameter
    # Not a released model: its config (in the file) gives this count; a scale test.
    "synthetic-moe-2.4t": 2_406_393_769_984,
}
WORLD_SIZES = (8, 64, 256, 1024, 3072, 8192, 10240)
# DeepSeek-V3's MoE layers at 1024 ranks were the one case above the padding target with the
# fixed orders (1.04%: experts of 2048 x 7168 are longer than a shard and shorter than two, so
# with S not a multiple of 7168 each may straddle only one boundary). The dynamic order "fit"
# reaches the lower bound there (0.16%); this test keeps it that way.
MOE_LAYER_1024 = ("deepseek-v3-671b-per-expert", 1024)


def test_presets_match_published_parameter_counts() -> None:
    assert set(preset_names()) == set(EXPECTED_PARAMS)
    for name, params in EXPECTED_PARAMS.items():
        preset = load_preset(name)
        assert preset.numel == params, name
        assert preset.groups[0].name == "embed" and preset.groups[-1].name == "final"
        assert preset.config, "each preset records the config values it was built from"


def test_group_names_are_unique_and_prefixed() -> None:
    preset = load_preset("deepseek-v3-671b-per-expert")
    assert len(preset.groups) == 61 + 2
    moe = preset.groups[4]
    names = [s.name for s in moe.specs()]
    assert len(names) == len(set(names)) == 9 + 2 + 3 * 257
    assert names[0].startswith("model.layers.3.")


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_shard_size_within_five_percent_of_the_bound(name) -> None:
    # Acceptance 3: S <= 1.05 x lower bound for every preset, world size and block size.
    # Identical layers plan identically, so each distinct group shape is planned once here.
    preset = load_preset(name)
    distinct = {tuple((e.shape, e.num_shard_dims) for e in g.entries): g for g in preset.groups}
    above_target = set()
    for block_rows in (1, 16, 32):
        for world in WORLD_SIZES:
            for group in distinct.values():
                specs = group.specs(block_rows)
                layout = plan_layout(specs, world)
                assert layout.shard_size <= 1.05 * layout.lower_bound, (
                    group.name,
                    world,
                    block_rows,
                )
                if block_rows == 1:
                    # Never more padding than FSDP2 or 0.5% of the group, unless the lower bound
                    # itself (no valid layout does better) forces it.
                    floor = world * layout.lower_bound - layout.total_numel
                    allowed = max(fsdp2_padding(specs, world), 0.005 * layout.total_numel, floor)
                    if layout.padding > allowed:
                        above_target.add((name, world))
    assert above_target == set(), above_target


def test_deepseek_moe_layer_reaches_the_lower_bound_with_fit() -> None:
    name, world = MOE_LAYER_1024
    specs = load_preset(name).groups[4].specs(1)
    fixed = min(plan_layout(specs, world, order=o).shard_size for o in ("given", "block", "size"))
    layout = plan_layout(specs, world)
    assert (
        layout.shard_size == layout.lower_bound == plan_layout(specs, world, order="fit").shard_size
    )
    assert fixed > layout.shard_size  # the fixed orders alone do not get there
    assert layout.padding_ratio < 0.002


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"groups": []}', "non-empty list"),
        ('{"name": "m"}', "'groups' or a 'tensors' key"),
        ('{"foo": 1}', r"unknown key\(s\) \['foo'\]; valid: name, source, config, groups"),
        (
            '{"tensors": [{"name": "a", "shape": [3], "num_shard_dim": 1}]}',
            r"tensor 'a': unknown key\(s\) \['num_shard_dim'\]; valid: name, shape, num_shard_dims",
        ),
        ('{"groups": [{"name": "g", "tensor": []}]}', "'tensors' list"),
        (
            '{"groups": [{"name": "g", "tensors": [], "size": 1}]}',
            r"group 'g': unknown key\(s\) \['size'\]",
        ),
        ('{"tensors": [{"name": "a", "numel": 100, "shape": [3]}]}', "numel 100 disagrees"),
        ('{"tensors": [{"name": "a", "shape": [3], "block": 2}]}', "'block' is for a 'numel'"),
        ('{"tensors": [{"name": "a", "numel": 3, "num_shard_dims": 2}]}', "needs a 'shape'"),
        (
            '{"groups": [{"name": "g", "tensors": [{"name": "a", "numel": 1}]},'
            ' {"name": "g", "tensors": [{"name": "b", "numel": 1}]}]}',
            r"group names must be unique, repeated: \['g'\]",
        ),
        (
            '{"groups": [{"name": "l{i}", "indices": [0, 100000000], "tensors": []}]}',
            "repeat the group 100,000,000 times; at most 100,000",
        ),
        ('{"tensors": [{"name": "a"}]}', "needs 'shape' or 'numel'"),
        ('{"tensors": [{"name": "a", "shape": [2, -1]}]}', "shape entry must be >= 0"),
        ('{"tensors": [{"shape": [2]}]}', "'name' string"),
        ('{"groups": [{"name": "l", "indices": [0, 2], "tensors": []}]}', "needs '{i}'"),
        ('{"groups": [{"name": "l{i}", "indices": [2, 1], "tensors": []}]}', "start < stop"),
    ],
)
def test_bad_group_files(text, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_model(text)


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown preset 'gpt5'; valid: deepseek-v3-671b"):
        load_preset("gpt5")


def test_readme_group_file_examples_parse() -> None:
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", readme, re.DOTALL)
    assert len(blocks) == 2
    single, model = (parse_model(block) for block in blocks)
    assert [s.block for s in single.groups[0].specs(block_rows=2)] == [8192, 8192, 128]
    assert [g.name for g in model.groups][:3] == ["embed", "layers.0", "layers.1"]
    assert len(model.groups) == 33


def test_layout_labels_keep_indices() -> None:
    from shard_planner._report import _common_prefix, _label

    names = [f"model.layers.3.mlp.experts.{e}.w1.weight" for e in (0, 12)]
    common = _common_prefix(names)
    assert common == "model.layers.3.mlp.experts."
    assert [_label(n, common) for n in names] == ["0.w1", "12.w1"]
    assert _common_prefix(["a.w", "b.w"]) == "" and _common_prefix(["x.y"]) == ""


def test_groups_compare_by_name_and_tensors_whatever_their_copies() -> None:
    shapes = {"l.w": (4, 8), "l.b": (4,)}
    group = GroupSpec.from_shapes("l", shapes)
    copy = GroupSpec("l", tuple(list(group.entries)))  # equal entries, another tuple
    assert copy == group and hash(copy) == hash(group) and copy.entries is not group.entries
    assert GroupSpec("m", group.entries) != group
    assert GroupSpec.from_shapes("l", {"l.w": (4, 9), "l.b": (4,)}) != group
    assert group != ("l", group.entries) and {group: 1}[copy] == 1
