"""Hugging Face accelerate's FSDP2 path, on a tiny transformers Llama, under torchrun.

`--engine ours` sets `torch.distributed.fsdp.fully_shard = fsdp_engine.fully_shard` before
`Accelerator.prepare`, which is all a user does: accelerate imports `fully_shard` from torch
at call time and finds the sharded modules with `isinstance(m, FSDPModule)`.

accelerate enables FSDP only for accelerator devices (on CPU it picks DDP), so after the
`Accelerator` is built this script sets its state's distributed type to FSDP: the same one
line for both engines, after which accelerate's own FSDP2 code runs unchanged (auto-wrap by
decoder layer, the embedding and [norm, lm_head] groups, the root, the optimizer's parameter
swap, `cpu_ram_efficient_loading`'s meta-device sharding and broadcast load, clipping,
`save_state` / `load_state` through torch.distributed.checkpoint).

Rank 0 prints one line, `ACCELERATE_RESULT [json per rank]`, with each rank's losses (mean
over ranks) and gradient norms of each step it ran and the FSDP modules it found.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64
SEQ = 16
NUM_SAMPLES = 48
LOCAL_BATCH = 2


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["fsdp2", "ours"], required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--cpu-ram-efficient-loading", action="store_true")
    parser.add_argument("--save-state", help="save_state into this folder after the last step")
    parser.add_argument("--load-state", help="load_state from this folder before the first step")
    parser.add_argument("--skip-steps", type=int, default=0, help="batches the loaded run did")
    return parser.parse_args()


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    args = _parse()
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if args.engine == "ours":
        import fsdp_engine

        torch.distributed.fsdp.fully_shard = fsdp_engine.fully_shard  # type: ignore[assignment]

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=args.cpu_ram_efficient_loading,
    )
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    # Both singletons: accelerate builds an AcceleratorState again later, from PartialState's.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if args.mixed_precision != "no":
        plugin.set_mixed_precision(args.mixed_precision)
    rank = dist.get_rank()

    # Every rank builds the same model unless rank 0 alone loads it (cpu_ram_efficient_loading:
    # the others start from other values, which the broadcast load must overwrite).
    torch.manual_seed(0 if rank == 0 or not args.cpu_ram_efficient_loading else 100 + rank)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens), batch_size=LOCAL_BATCH, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.load_state:
        accelerator.load_state(args.load_state)
        loader = accelerator.skip_first_batches(loader, args.skip_steps)

    sharded = [
        type(m).__name__
        for m in model.modules()
        if isinstance(m, torch.distributed.fsdp.FSDPModule)
    ]
    losses, grad_norms = [], []
    for step, (batch,) in enumerate(loader):
        if step == args.steps:
            break
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    if args.save_state:
        accelerator.save_state(args.save_state)
    report = {"rank": rank, "losses": losses, "grad_norms": grad_norms, "fsdp_modules": sharded}
    reports: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)  # one line from rank 0: ranks' prints interleave
    if rank == 0:
        print("ACCELERATE_RESULT " + json.dumps(reports), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
