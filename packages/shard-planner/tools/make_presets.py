"""Writes the model presets shipped in src/shard_planner/presets/ from public config values.

Run from the package folder: `python tools/make_presets.py`. Each preset records the config
values it was built from. Tensor names and shapes are those of the model as transformers 5
builds it (`named_parameters()`: its MoE layers hold each projection's experts in one fused
tensor); the `-per-expert` presets name one module per expert, as the checkpoints (and
torchtitan's per-expert models) do. Groups follow how FSDP wraps a decoder: the embedding,
each transformer block, then the final norm with the head. The repository's
tests/test_presets_match_transformers.py checks names and shapes against transformers.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

OUT = pathlib.Path(__file__).resolve().parents[1] / "src" / "shard_planner" / "presets"

Tensor = dict[str, Any]


def t(name: str, *shape: int, num_shard_dims: int = 1) -> Tensor:
    entry: Tensor = {"name": name, "shape": list(shape)}
    if num_shard_dims != 1:
        entry["num_shard_dims"] = num_shard_dims
    return entry


def ends(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    embed = {"name": "embed", "tensors": [t("model.embed_tokens.weight", vocab, hidden)]}
    final = {
        "name": "final",
        "tensors": [t("model.norm.weight", hidden), t("lm_head.weight", vocab, hidden)],
    }
    return embed, final


def decoder(name: str, source: str, cfg: dict[str, Any], layer: list[Tensor]) -> dict[str, Any]:
    """A model of identical layers between the embedding and the final norm + head."""
    embed, final = ends(cfg)
    layers = {
        "name": "model.layers.{i}",
        "indices": [0, cfg["num_hidden_layers"]],
        "tensors": layer,
    }
    return {"name": name, "source": source, "config": cfg, "groups": [embed, layers, final]}


def llama3(name: str, source: str, cfg: dict[str, Any]) -> dict[str, Any]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    layer = [
        t("self_attn.q_proj.weight", h, h),
        t("self_attn.k_proj.weight", kv, h),
        t("self_attn.v_proj.weight", kv, h),
        t("self_attn.o_proj.weight", h, h),
        t("mlp.gate_proj.weight", inter, h),
        t("mlp.up_proj.weight", inter, h),
        t("mlp.down_proj.weight", h, inter),
        t("input_layernorm.weight", h),
        t("post_attention_layernorm.weight", h),
    ]
    return decoder(name, source, cfg, layer)


def fused_experts(num_experts: int, h: int, inter: int) -> list[Tensor]:
    """One layer's routed experts as transformers 5 holds them: one tensor per projection."""
    return [
        t("mlp.experts.gate_up_proj", num_experts, 2 * inter, h, num_shard_dims=2),
        t("mlp.experts.down_proj", num_experts, h, inter, num_shard_dims=2),
    ]


def deepseek_v3(
    name: str = "deepseek-v3-671b",
    source: str = "deepseek-ai/DeepSeek-V3 config.json, as transformers 5 builds it (experts "
    "fused per projection)",
    *,
    fused: bool = True,
    **changes: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "tie_word_embeddings": False,
        "note": "the multi-token-prediction module (num_nextn_predict_layers=1) is not included",
    }
    cfg.update(changes)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    attn = [
        t("self_attn.q_a_proj.weight", q_rank, h),
        t("self_attn.q_a_layernorm.weight", q_rank),
        t("self_attn.q_b_proj.weight", heads * (nope + rope), q_rank),
        t("self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, h),
        t("self_attn.kv_a_layernorm.weight", kv_rank),
        t("self_attn.kv_b_proj.weight", heads * (nope + v), kv_rank),
        t("self_attn.o_proj.weight", h, heads * v),
        t("input_layernorm.weight", h),
        t("post_attention_layernorm.weight", h),
    ]

    def mlp(prefix: str, inter: int) -> list[Tensor]:
        return [
            t(f"{prefix}.gate_proj.weight", inter, h),
            t(f"{prefix}.up_proj.weight", inter, h),
            t(f"{prefix}.down_proj.weight", h, inter),
        ]

    moe_inter, num_experts = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    norms = attn[-2:]
    if fused:  # transformers 5: the router's bias correction is a buffer, not a parameter
        moe = [*attn[:-2], *fused_experts(num_experts, h, moe_inter)]
        moe += [t("mlp.gate.weight", num_experts, h)]
        moe += [*mlp("mlp.shared_experts", moe_inter * cfg["n_shared_experts"]), *norms]
        dense = [*attn[:-2], *mlp("mlp", cfg["intermediate_size"]), *norms]
    else:
        moe = [
            *attn,
            t("mlp.gate.weight", num_experts, h),
            t("mlp.gate.e_score_correction_bias", num_experts),
        ]
        for e in range(num_experts):
            moe += mlp(f"mlp.experts.{e}", moe_inter)
        moe += mlp("mlp.shared_experts", moe_inter * cfg["n_shared_experts"])
        dense = attn + mlp("mlp", cfg["intermediate_size"])
    dense_layers = cfg["first_k_dense_replace"]
    embed, final = ends(cfg)
    groups = [
        embed,
        {
            "name": "model.layers.{i}",
            "indices": [0, dense_layers],
            "tensors": dense,
        },
        {
            "name": "model.layers.{i}",
            "indices": [dense_layers, cfg["num_hidden_layers"]],
            "tensors": moe,
        },
        final,
    ]
    return {"name": name, "source": source, "config": cfg, "groups": groups}


def gpt_oss_120b() -> dict[str, Any]:
    cfg = {
        "vocab_size": 201088,
        "hidden_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "intermediate_size": 2880,
        "tie_word_embeddings": False,
        "note": "experts fused in one tensor per projection, shape (experts, in, out); a row "
        "is one matrix row (num_shard_dims=2), FSDP2 shards the expert dim",
    }
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    num_experts, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    layer = [
        t("input_layernorm.weight", h),
        t("self_attn.q_proj.weight", q, h),
        t("self_attn.q_proj.bias", q),
        t("self_attn.k_proj.weight", kv, h),
        t("self_attn.k_proj.bias", kv),
        t("self_attn.v_proj.weight", kv, h),
        t("self_attn.v_proj.bias", kv),
        t("self_attn.o_proj.weight", h, q),
        t("self_attn.o_proj.bias", h),
        t("self_attn.sinks", cfg["num_attention_heads"]),
        t("post_attention_layernorm.weight", h),
        t("mlp.router.weight", num_experts, h),
        t("mlp.router.bias", num_experts),
        t("mlp.experts.gate_up_proj", num_experts, h, 2 * inter, num_shard_dims=2),
        t("mlp.experts.gate_up_proj_bias", num_experts, 2 * inter),
        t("mlp.experts.down_proj", num_experts, inter, h, num_shard_dims=2),
        t("mlp.experts.down_proj_bias", num_experts, h),
    ]
    return decoder("gpt-oss-120b", "openai/gpt-oss-120b config.json (fused experts)", cfg, layer)


QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "moe_intermediate_size": 768,
    "tie_word_embeddings": False,
}
QWEN3_235B_A22B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "moe_intermediate_size": 1536,
    "tie_word_embeddings": False,
}


def qwen3_moe(name: str, model: str, cfg: dict[str, Any], fused: bool = True) -> dict[str, Any]:
    """A Qwen3-MoE model (every layer sparse), from its Hugging Face id and config values."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    num_experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    layer = [
        t("self_attn.q_proj.weight", q, h),
        t("self_attn.k_proj.weight", kv, h),
        t("self_attn.v_proj.weight", kv, h),
        t("self_attn.o_proj.weight", h, q),
        t("self_attn.q_norm.weight", hd),
        t("self_attn.k_norm.weight", hd),
    ]
    if fused:
        layer += [*fused_experts(num_experts, h, inter), t("mlp.gate.weight", num_experts, h)]
    else:
        layer.append(t("mlp.gate.weight", num_experts, h))
        for e in range(num_experts):
            layer += [
                t(f"mlp.experts.{e}.gate_proj.weight", inter, h),
                t(f"mlp.experts.{e}.up_proj.weight", inter, h),
                t(f"mlp.experts.{e}.down_proj.weight", h, inter),
            ]
    layer += [t("input_layernorm.weight", h), t("post_attention_layernorm.weight", h)]
    if fused:
        source = f"{model} config.json, as transformers 5 builds it (experts fused)"
        return decoder(name, source, cfg, layer)
    source = f"{model} config.json, one module per expert (checkpoint names)"
    return decoder(f"{name}-per-expert", source, cfg, layer)


LLAMA_VOCAB = 128256


def render(preset: dict[str, Any]) -> str:
    """JSON with one tensor per line: diffable and still small."""
    head = {k: v for k, v in preset.items() if k != "groups"}
    lines = ["{"]
    for key, value in head.items():
        lines.append(f" {json.dumps(key)}: {json.dumps(value)},")
    lines.append(' "groups": [')
    for g, group in enumerate(preset["groups"]):
        meta = {k: v for k, v in group.items() if k != "tensors"}
        lines.append("  {" + json.dumps(meta)[1:-1] + ', "tensors": [')
        tensors = [f"   {json.dumps(x)}" for x in group["tensors"]]
        lines.append(",\n".join(tensors))
        lines.append("  ]}" + ("," if g + 1 < len(preset["groups"]) else ""))
    lines.append(" ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == preset
    return text


def main() -> None:
    presets = [
        llama3(
            "llama3-8b",
            "meta-llama/Meta-Llama-3-8B config.json",
            {
                "vocab_size": LLAMA_VOCAB,
                "hidden_size": 4096,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "tie_word_embeddings": False,
            },
        ),
        llama3(
            "llama3-70b",
            "meta-llama/Meta-Llama-3-70B config.json",
            {
                "vocab_size": LLAMA_VOCAB,
                "hidden_size": 8192,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "intermediate_size": 28672,
                "tie_word_embeddings": False,
            },
        ),
        llama3(
            "llama3-405b",
            "meta-llama/Llama-3.1-405B config.json",
            {
                "vocab_size": LLAMA_VOCAB,
                "hidden_size": 16384,
                "num_hidden_layers": 126,
                "num_attention_heads": 128,
                "num_key_value_heads": 8,
                "intermediate_size": 53248,
                "tie_word_embeddings": False,
            },
        ),
        deepseek_v3(),
        deepseek_v3(
            "deepseek-v3-671b-per-expert",
            "deepseek-ai/DeepSeek-V3 config.json, one module per expert (checkpoint names)",
            fused=False,
        ),
        gpt_oss_120b(),
        qwen3_moe("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", QWEN3_30B_A3B),
        qwen3_moe("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", QWEN3_30B_A3B, fused=False),
        qwen3_moe("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", QWEN3_235B_A22B),
        # Not a released model: a scale test for the planner, about 2.4 trillion parameters.
        deepseek_v3(
            "synthetic-moe-2.4t",
            "synthetic: DeepSeek-V3's block with 1,024 routed experts per MoE layer, 56 layers",
            fused=False,
            n_routed_experts=1024,
            num_hidden_layers=56,
            note="not a released model: DeepSeek-V3's layer shapes with 4x the experts and "
            "3 dense + 53 MoE layers (no multi-token-prediction module)",
        ),
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    for preset in presets:
        path = OUT / f"{preset['name']}.json"
        path.write_text(render(preset))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
