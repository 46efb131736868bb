"""Hugging Face transformers models under fully_shard, run on every rank of a RankPool.

Tiny models built from configs (nothing is downloaded): a Llama and a Qwen3-MoE (its experts
are fused 3-D parameters in transformers 5). Each decoder layer is `fully_shard`ed, then the
root, as transformers' and torchtitan's recipes do; every check compares with one process
(and training with torch FSDP2 on the same model, seed and data).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from fsdp_engine import fully_shard

VOCAB = 64
SEQ = 9
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def build(arch: str, *, device: str = "cpu") -> nn.Module:
    """A tiny causal LM of `arch` ("llama" or "qwen3_moe"), seeded by the caller."""
    with torch.device(device):
        if arch == "llama":
            return LlamaForCausalLM(LlamaConfig(**_COMMON))
        config = Qwen3MoeConfig(
            **_COMMON,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            experts_implementation="eager",  # grouped_mm has no float64 on CPU
        )
        return Qwen3MoeForCausalLM(config)


def shard(model: nn.Module, engine: str) -> nn.Module:
    """Each decoder layer, then the root, with our fully_shard or torch's."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    apply: Any = fully_shard if engine == "ours" else torch_fully_shard
    for layer in model.model.layers:  # type: ignore[union-attr]
        apply(layer, mesh=mesh)
    apply(model, mesh=mesh)
    return model


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def _tokens(seed: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def check_training(arch: str, checkpointing: bool) -> None:
    """`model(input_ids=x, labels=x).loss` trains as one process and as FSDP2 (3 SGD steps with
    momentum, each rank on its own rows of the batch).

    transformers computes the loss on float32 logits, so the gradients differ from one
    process's by float32 rounding (~1e-9 here, in ours and FSDP2's alike): SGD keeps that
    difference, where AdamW would blow it up for near-zero gradients.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    # float64: a top-2 router's near-ties flip on fp32 rounding noise.
    reference = build(arch).to(torch.float64)
    if checkpointing:
        reference.gradient_checkpointing_enable()  # type: ignore[operator]
    models = {
        "reference": reference,
        "ours": shard(copy.deepcopy(reference), "ours"),
        "fsdp2": shard(copy.deepcopy(reference), "fsdp2"),
    }
    for model in models.values():
        model.train()
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    losses: dict[str, list[float]] = {k: [] for k in models}
    for step in range(3):
        batch = _tokens(step, 2 * world)
        for name, model in models.items():
            rows = batch if name == "reference" else batch[2 * rank : 2 * rank + 2]
            out = model(input_ids=rows, labels=rows)
            assert type(out).__name__.endswith("CausalLMOutputWithPast"), type(out)
            out.loss.backward()
            optims[name].step()
            optims[name].zero_grad()
            loss = out.loss.detach()
            if name != "reference":
                dist.all_reduce(loss)
                loss /= world
            losses[name].append(loss.item())
    if checkpointing:
        # The recompute inside backward is not a run of its own: one reduce-scatter per group.
        from torch.profiler import profile

        rows = _tokens(9, 2)
        with profile() as prof:
            models["ours"](input_ids=rows, labels=rows).loss.backward()
        reduces = [e for e in prof.events() if e.name.startswith("FSDP::reduce_scatter(")]
        assert len(reduces) == len(reference.model.layers) + 1, [e.name for e in reduces]  # type: ignore[union-attr, arg-type]
        optims["ours"].zero_grad()
    torch.testing.assert_close(losses["ours"], losses["reference"])
    torch.testing.assert_close(losses["ours"], losses["fsdp2"])
    expected = dict(reference.named_parameters())
    theirs = dict(models["fsdp2"].named_parameters())
    for name, param in models["ours"].named_parameters():
        torch.testing.assert_close(_full(param), expected[name], msg=name)
        torch.testing.assert_close(_full(param), _full(theirs[name]), msg=name)


def check_generate_with_uneven_eos() -> dict[str, int]:
    """generate() with another prompt per rank, where rank 0 reaches EOS first: the ranks keep
    stepping together (transformers' synced_gpus, on because the model is FSDP-managed) and
    each gets one process's output for its prompt."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = build("llama").eval()
    prompts = [_tokens(100 + r, 1)[:, :4] for r in range(world)]
    # EOS: rank 0's first generated token, so that rank 0 stops after one token.
    eos = int(reference.generate(prompts[0], max_new_tokens=1, do_sample=False)[0, -1])  # type: ignore[operator]
    settings = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    expected = [reference.generate(p, **settings) for p in prompts]  # type: ignore[operator]
    lengths = [e.shape[1] for e in expected]
    assert lengths[0] == 5 and (world == 1 or max(lengths) > 5), lengths
    model = shard(copy.deepcopy(reference), "ours")
    got = model.generate(prompts[rank], **settings)  # type: ignore[operator]
    assert torch.equal(got, expected[rank]), (got, expected[rank])
    return {"length": got.shape[1]}


def check_state_dicts(path: str) -> None:
    """save_pretrained of the full state dict, from_pretrained back, and loading pretrained
    weights from rank 0 only (broadcast_from_rank0) into a model built on meta."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = build("llama")
    model = shard(copy.deepcopy(reference), "ours")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if rank == 0:
        reference.save_pretrained(path, state_dict=full)  # type: ignore[operator]
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(path)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, dict(reference.named_parameters())[name]), name
    meta = shard(build("llama", device="meta"), "ours")
    meta.to_empty(device="cpu")
    meta.initialize_weights()  # type: ignore[operator]  # the buffers (rotary), then loaded
    given = dict(loaded.state_dict()) if rank == 0 else {}
    set_model_state_dict(
        meta, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    tokens = _tokens(7, 2)
    torch.testing.assert_close(meta(input_ids=tokens).logits, reference(input_ids=tokens).logits)


def check_meta_init(arch: str) -> None:
    """Built on meta, sharded, `to_empty`, then the model's own `initialize_weights()`: every
    parameter equals one process's init with the same seed."""
    model = shard(build(arch, device="meta"), "ours")
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.initialize_weights()  # type: ignore[operator]
    reference = build(arch, device="meta")
    reference.to_empty(device="cpu")
    torch.manual_seed(3)
    reference.initialize_weights()  # type: ignore[operator]
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(_full(param), expected[name]), name
