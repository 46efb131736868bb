"""Group granularity: experts as groups of their own, the search over it, the printed layout."""

from __future__ import annotations

import pytest

from shard_planner import GroupSpec, advise, estimate, load_preset
from shard_planner._cli import main
from shard_planner._granularity import dense_blocks, fully_shard_calls, has_experts, split_experts


def test_split_experts_keeps_every_tensor_once_in_forward_order() -> None:
    groups = load_preset("deepseek-v3-671b-per-expert").groups
    assert has_experts(groups) == 256
    for k in (1, 2, 8, 256):
        split = split_experts(groups, k)
        assert split is not None
        assert len(split) == len(groups) + 58 * k  # 58 MoE blocks, 3 dense
        assert sorted(e.name for g in split for e in g.entries) == sorted(
            e.name for g in groups for e in g.entries
        )
        moe = [
            g
            for g in split
            if g.name.split("[")[0] in ("model.layers.3", "model.layers.3.mlp.experts")
        ]
        assert moe[0].name == "model.layers.3" and len(moe) == 1 + k  # attention etc. first
        assert all("experts." not in e.name or "shared" in e.name for e in moe[0].entries)
        sizes = {g.numel for g in moe[1:]}
        assert len(sizes) == 1  # 256 experts split evenly
    assert split_experts(groups, 0) == groups
    assert split_experts(groups, 257) is None
    gpt = load_preset("gpt-oss-120b").groups  # fused experts: one group of them at most
    assert has_experts(gpt) == 1
    assert split_experts(gpt, 2) is None
    fused = split_experts(gpt, 1)
    assert fused is not None and fused[2].name == "model.layers.0.mlp.experts"
    assert split_experts(load_preset("llama3-8b").groups, 4) == load_preset("llama3-8b").groups


def test_layout_is_runnable_python_with_loops() -> None:
    groups = load_preset("deepseek-v3-671b-per-expert").groups
    split = split_experts(groups, 8)
    assert split is not None
    assert fully_shard_calls(split) == [
        "fully_shard(model.model.embed_tokens)",
        "for i in range(0, 3):",
        "    fully_shard(model.model.layers[i])",
        "for i in range(3, 61):",
        "    for lo in range(0, 256, 32):",
        "        fully_shard([model.model.layers[i].mlp.experts[j] for j in range(lo, lo + 32)])",
        "    fully_shard(model.model.layers[i])",
        "fully_shard([model.model.norm, model.lm_head])",
        "fully_shard(model)",
    ]
    calls: list[tuple[str, ...]] = []

    class Path:  # records the modules the code reaches
        def __init__(self, path: str) -> None:
            self.path = path

        def __getattr__(self, name: str) -> Path:
            return Path(f"{self.path}.{name}")

        def __getitem__(self, index: int) -> Path:
            return Path(f"{self.path}.{index}")

    def record(modules: object) -> None:
        items = modules if isinstance(modules, list) else [modules]
        calls.append(tuple(m.path for m in items))  # type: ignore[attr-defined]

    exec("\n".join(fully_shard_calls(split)), {"model": Path("m"), "fully_shard": record})
    # Bottom-up and complete: each expert group before its block, every group once.
    assert len(calls) == len(split) + 1
    assert calls[4] == tuple(f"m.model.layers.3.mlp.experts.{j}" for j in range(32))
    assert calls[4 + 8] == ("m.model.layers.3",)
    assert calls[-1] == ("m",)


def test_advise_fits_deepseek_at_1024_by_splitting_experts(capsys) -> None:
    groups = load_preset("deepseek-v3-671b-per-expert").groups
    memory = 80 * 2**30
    whole = advise(groups, num_ranks=1024, ranks_per_node=8, memory_bytes=memory,
                   compute_bytes=2, expert_groups=(0,))  # fmt: skip
    assert whole == []  # no mesh split fits with blocks whole (117.0 GiB at best)
    ranked = advise(groups, num_ranks=1024, ranks_per_node=8, memory_bytes=memory,
                    compute_bytes=2)  # fmt: skip
    assert ranked and ranked[0].expert_groups > 0 and ranked[0].headroom >= 0.1
    two = [c for c in ranked if c.expert_groups == 2 and c.shard_size == 1024]
    assert round(two[0].memory_bytes / 2**30, 1) == 52.5  # what splitting in 2 was found to give
    argv = ["advise", "--preset", "deepseek-v3-671b-per-expert", "--ranks", "1024"]
    argv += ["--memory-gb", "80"]
    assert main([*argv, "--compute-bytes", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 2 x 512 | experts in 4, dense blocks on 8 |" in out
    assert "| 2 | 4 x 256 | experts in 8 |" in out
    assert 'mesh = init_device_mesh("cuda", (2, 512), mesh_dim_names=("replicate", "shard"))' in out
    assert (
        '    dense_mesh = init_device_mesh("cuda", (128, 8), mesh_dim_names=("replicate", "shard"))'
        in out
    )
    assert "        block_rows=1,\n" in out
    assert "        fully_shard(model.model.layers[i], mesh=dense_mesh)" in out
    assert (
        "        fully_shard([model.model.layers[i].mlp.experts[j] for j in range(lo, lo + 64)])"
        in out
    )
    assert "every rank must run each group" in out


def test_bad_granularity() -> None:
    gpt = load_preset("gpt-oss-120b").groups
    with pytest.raises(ValueError, match="cannot form 2 groups per block"):
        advise(gpt, num_ranks=64, ranks_per_node=8, memory_bytes=2**36, expert_groups=(2,))
    with pytest.raises(ValueError, match="expert_groups entry must be >= 0"):
        advise(gpt, num_ranks=64, ranks_per_node=8, memory_bytes=2**36, expert_groups=(-1,))
    plain = [GroupSpec.from_shapes("g", {"w": (64, 64)})]
    only = advise(plain, num_ranks=4, ranks_per_node=4, memory_bytes=2**30)
    assert {c.expert_groups for c in only} == {0}  # nothing to split: blocks as given


def test_dense_blocks_on_a_sub_mesh_pad_less() -> None:
    # DeepSeek-V3's 3 dense layers with 16-row blocks over 1024 ranks: few, long rows that
    # pad most of the model's 12.25%; over a node's 8 ranks they pad almost nothing.
    groups = load_preset("deepseek-v3-671b-per-expert").groups
    assert dense_blocks(groups).count(True) == 3
    whole = estimate(groups, shard_size=1024, compute_bytes=2, block_rows=16)
    apart = estimate(groups, shard_size=1024, compute_bytes=2, block_rows=16,
                     dense_shard_size=8)  # fmt: skip
    assert f"{whole.padding_ratio:.2%}" == "12.25%" and f"{apart.padding_ratio:.2%}" == "4.95%"
    assert apart.memory_bytes < whole.memory_bytes
    # Their copies (1024 / 8 = 128 per dense block) all-reduce the dense blocks' gradients.
    assert whole.all_reduce_bytes == 0 < apart.all_reduce_bytes
    dense_numel = sum(g.numel for g, d in zip(groups, dense_blocks(groups), strict=True) if d)
    assert apart.all_reduce_bytes >= dense_numel / 8 * 4
    with pytest.raises(ValueError, match="dense_shard_size 3 must divide shard_size 1024"):
        estimate(groups, shard_size=1024, dense_shard_size=3)
    with pytest.raises(ValueError, match="this model has none"):
        estimate(load_preset("llama3-8b").groups, shard_size=8, dense_shard_size=4)
