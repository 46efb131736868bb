"""torchtitan's own trainer with its shipped llama3 debug-model config, on CPU gloo ranks.

Launched by `test_frameworks.py` under torchrun, once per engine: `--engine fsdp2` runs
torchtitan as it ships, `--engine ours` first puts `fsdp_engine.fully_shard` where torchtitan
imports FSDP2's from (`torch.distributed.fsdp.fully_shard`, the one change a user makes).
Everything else is the same for both engines: the shipped config (chunked loss, fused AdamW,
its init, its default SPMD backend, warmup + linear decay) with a shorter sequence and batch
so that a step takes about a second on one CPU core, torchtitan's trainer, data loader and
checkpointer. What a CPU machine needs and torchtitan does not ship, the same for both:
- a device shim: torchtitan takes "cuda" as its device when no accelerator is present;
- eager attention: its FlexAttention compiles `flex_attention` with inductor (the same maths);
- a tiny word-level tokenizer and a local text dataset (nothing may download), written by the
  test into `--assets`.
Prints one JSON line per rank at the end: the logged loss and gradient norm of every step,
and the divide factor each FSDP module reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["fsdp2", "ours"], required=True)
    parser.add_argument("--model", choices=["llama3", "deepseek_v3"], default="llama3")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    parser.add_argument("--typecheck", action="store_true", help="spmd_types type checking")
    parser.add_argument("--assets", required=True, help="folder with tokenizer/ and data/")
    parser.add_argument("--dump-folder", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch-size", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--checkpoint-interval", type=int, default=0, help="0: no checkpoint")
    parser.add_argument("--load-step", type=int, default=-1)
    parser.add_argument("--initial-load", default=None, help="a seed checkpoint to start from")
    parser.add_argument(
        "--seed-checkpoint", action="store_true", help="one rank: save the initial weights"
    )
    return parser.parse_args()


def write_assets(folder: str, num_words: int = 300, num_documents: int = 400) -> None:
    """A word-level tokenizer (`tokenizer/`) and a JSON-lines text dataset (`data/`).

    The documents are random walks over the words with a fixed rule, so there is something
    to learn (the loss falls) and nothing to download.
    """
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(0)
    words = [f"w{i}" for i in range(num_words)]
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    vocab.update({word: 3 + i for i, word in enumerate(words)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer", "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    with open(os.path.join(folder, "tokenizer", "tokenizer_config.json"), "w") as file:
        json.dump(special, file)
    with open(os.path.join(folder, "data", "train.jsonl"), "w") as file:
        for _ in range(num_documents):
            index = rng.randrange(num_words)
            walk = [index]
            for _ in range(rng.randint(20, 200)):
                index = (index * 7 + rng.randint(0, 3)) % num_words
                walk.append(index)
            file.write(json.dumps({"text": " ".join(words[i] for i in walk)}) + "\n")


def _cpu_device_shim() -> None:
    """Point torchtitan's device globals at the CPU (each module bound its own copy)."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils

    device_module = types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        synchronize=lambda *args: None,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *args: None,
        memory_stats=lambda *args: {},
        get_device_name=lambda *args: "cpu",
        get_device_properties=lambda *args: types.SimpleNamespace(total_memory=1 << 34),
    )
    for module in (utils, metrics, dist_utils, parallel_dims):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"  # type: ignore[attr-defined]
        if hasattr(module, "device_module"):
            module.device_module = device_module  # type: ignore[attr-defined]
    utils.get_local_device = lambda: torch.device("cpu")
    dist_utils.get_local_device = utils.get_local_device  # type: ignore[attr-defined]


def _eager_attention() -> None:
    """FlexAttention's maths without its kernel (which has no backward on CPU): the block
    mask's `mask_mod` made dense, then scaled-dot-product attention."""
    from torch.nn import functional
    from torch.nn.attention import flex_attention as flex
    from torchtitan.models.common import attention

    def masked_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        score_mod: Any,
        block_mask: Any,
        scale: float | None,
        enable_gqa: bool,
        return_aux: Any,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("this shim covers masks only (llama3's attention)")
        batch, _, q_len, _ = q.shape
        mask = flex.create_mask(block_mask.mask_mod, batch, None, q_len, k.shape[2], q.device)
        out = functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, None

    attention.FlexAttention._compiled_flex_attn = staticmethod(masked_attention)
    attention._compiled_create_block_mask = flex.create_block_mask


def main() -> None:
    args = _parse()
    if args.engine == "ours":
        # The swap a user makes: torchtitan imports fully_shard from torch.distributed.fsdp
        # when its modules load, so the name is replaced before torchtitan is imported.
        import torch.distributed.fsdp as torch_fsdp

        import fsdp_engine

        torch_fsdp.fully_shard = fsdp_engine.fully_shard  # type: ignore[assignment]

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.autograd.set_multithreading_enabled(False)  # what torchtitan's own init does
    _cpu_device_shim()
    _eager_attention()

    import importlib

    from torchtitan.trainer import Trainer

    registry = importlib.import_module(f"torchtitan.models.{args.model}.config_registry")
    config = getattr(registry, f"{args.model}_debugmodel")()
    config.hf_assets_path = os.path.join(args.assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(args.assets, "data")
    config.dump_folder = args.dump_folder
    config.training.steps = args.steps
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = args.local_batch_size
    config.training.mixed_precision_param = args.dtype
    config.training.disable_cuda_graphs = True
    config.parallelism.expert_parallel_degree = args.ep
    config.validator.enable = False
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    # torchtitan reads initial_load_path only with checkpointing enabled.
    config.checkpoint.enable = bool(
        args.checkpoint_interval or args.seed_checkpoint or args.initial_load
    )
    config.checkpoint.create_seed_checkpoint = args.seed_checkpoint
    config.checkpoint.interval = args.checkpoint_interval or args.steps
    config.checkpoint.load_step = args.load_step
    config.checkpoint.keep_latest_k = 0
    config.checkpoint.initial_load_path = args.initial_load
    config.debug.seed = 0
    config.debug.spmd_typechecking = args.typecheck

    trainer = Trainer(config)
    if args.seed_checkpoint:  # what torchtitan's train.py does for --create_seed_checkpoint
        trainer.checkpointer.save(curr_step=0, last_step=True)
        trainer.close()
        dist.destroy_process_group()
        return
    from torch.distributed.fsdp import FSDPModule

    for module in trainer.model_parts[0].modules():
        if isinstance(module, FSDPModule):
            # gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's divide factor of 1.
            module.set_force_sum_reduction_for_comms(True)
    logged: list[dict[str, float]] = []
    log = trainer.metrics_processor.log

    def recording_log(step: int, loss: float, max_loss: float, grad_norm: float, *a: Any, **k: Any):
        logged.append({"step": step, "loss": float(loss), "grad_norm": float(grad_norm)})
        return log(step, loss, max_loss, grad_norm, *a, **k)

    trainer.metrics_processor.log = recording_log
    try:
        trainer.train()
    finally:
        trainer.close()

    model = trainer.model_parts[0]
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    report = {
        "rank": dist.get_rank(),
        "engine": args.engine,
        "class": type(model).__mro__[1].__module__,
        "num_fsdp_modules": len(fsdp_modules),
        "steps": logged,
    }
    print("TORCHTITAN_RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
