"""Fine-tune a Hugging Face transformers model with fsdp_engine, then generate.

Runs as is on one rank (`python examples/hf_finetune.py`), or on several with
`torchrun --nproc-per-node N examples/hf_finetune.py` (gloo on CPU). The model is a tiny Llama
built from a config (nothing is downloaded); for a real one, build it the same way from
`AutoConfig.from_pretrained(name)` and load its weights with the broadcast below.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_engine import fully_shard


def main() -> None:
    """Shard, initialize, load, train three steps and generate (see the module docstring)."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(key, value)
    dist.init_process_group(
        "gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1))
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )

    # Build on meta (no memory), shard each decoder layer and then the root, allocate only
    # this rank's shards, and initialize: the model's own init gives one process's values.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.initialize_weights()

    # Pretrained weights: rank 0 alone holds them (here: a model of its own), every rank gets
    # its shards.
    pretrained = {}
    if rank == 0:
        torch.manual_seed(1)
        pretrained = LlamaForCausalLM(config).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, pretrained, options=options)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank)
    )
    for step in range(3):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    # Another prompt per rank; ranks that reach EOS first keep stepping with the others.
    model.eval()
    with torch.no_grad():
        # transformers types generate's `self` as a protocol its own models do not match.
        out = model.generate(  # type: ignore[misc]
            tokens[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    print(f"rank {rank}/{world}: generated {out[0, 4:].tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
