"""Checkpoints and initialization: DCP across world sizes and FSDP2, meta init, full loads."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from engine_support import (
    SEQ,
    make_batches,
    run_steps,
    sharded_model,
)
from model import Config, Decoder, loss_fn
from profiling import peak_live_bytes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_engine
from fsdp_engine import fully_shard
from ragged_placement import RaggedShard


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state as full state dicts (on rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }


def check_checkpoint_save(directory: str, engine: str) -> None:
    """Trains 2 steps, saves with DCP, records the full state, trains 2 more, records again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, opt = sharded_model(engine, seed=0)
    batches = [b[0] for b in make_batches(4, 1)]
    run_steps(model, opt, batches[:2])
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=f"{directory}/dcp")
    full = copy.deepcopy(full_state(model, opt))  # AdamW's step tensors are shared
    run_steps(model, opt, batches[2:])
    after = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save({"saved": full, "after": after}, f"{directory}/full.pt")
    dist.barrier()


def check_checkpoint_load(directory: str, engine: str, resume: bool) -> None:
    """Loads the DCP checkpoint into a differently initialized model: bit-exact state.

    `resume`: also train the 2 steps after the save and match the uninterrupted run exactly
    (same world size only: the per-rank batches and the reduction order must be the same).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = sharded_model(engine, seed=123)
    storages = {n: p.to_local().untyped_storage().data_ptr() for n, p in model.named_parameters()}
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=f"{directory}/dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    if engine.startswith("ours"):  # still views of the DBuffer: the next gather sends them
        for name, param in model.named_parameters():
            assert param.to_local().untyped_storage().data_ptr() == storages[name], name
    expected = torch.load(f"{directory}/full.pt", weights_only=False)
    _assert_state_equal(full_state(model, opt), expected["saved"])
    if resume:
        batches = [b[0] for b in make_batches(4, 1)]
        run_steps(model, opt, batches[2:])
        _assert_state_equal(full_state(model, opt), expected["after"])


def _assert_state_equal(got: dict[str, Any], expected: dict[str, Any]) -> None:
    if dist.get_rank() != 0:  # full state dicts live on rank 0
        return
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), name
    for fqn, state in expected["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optim"]["state"][fqn][key], value), (fqn, key)


def _init_weights(model: nn.Module) -> None:
    """The torchtitan / transformers flow after to_empty: each module's own reset, then
    nn.init calls of the model's (the same calls, in the same order, on any world size)."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif "attn" in name:
            nn.init.trunc_normal_(param, std=0.02, a=-0.04, b=0.04)


def check_meta_init(offload: bool = False) -> dict[str, int]:
    """Meta-device model -> fully_shard -> to_empty -> the model's own init: the parameters
    equal one process's init with the same seed, and the peak is about one shard (plus one
    full parameter at a time: a random fill draws the whole tensor on every rank).

    `offload`: with CPUOffloadPolicy, as a fine-tuning job builds a model too large for the
    device: the shards materialize in host memory (the buffers stay offloaded).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = Config(vocab=2048, dim=256, num_heads=4, num_layers=4, hidden=688)
    with torch.device("meta"):
        model = Decoder(cfg)
        reference = Decoder(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    def build() -> None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        _init_weights(model)

    peak = peak_live_bytes(build)
    shard_bytes = sum(g.shard_numel * g.dtype.itemsize for g in fsdp_engine.sharding_summary(model))
    reference.to_empty(device="cpu")
    torch.manual_seed(0)
    _init_weights(reference)
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert not param.is_meta and param.device.type == "cpu"
        assert torch.equal(param.full_tensor(), expected[name]), name
    from fsdp_engine._state import STATE_ATTR

    for module in model.modules():
        state = getattr(module, STATE_ATTR, None)
        if state is not None and state.group is not None:
            for buffer in state.group.buffers:
                assert (buffer.host_shard is not None) == offload, buffer
                assert buffer.device.type == "cpu" and buffer.local.device.type == "cpu"
    # The shard, one full parameter and its piece, and small temporaries (the gradient
    # shard is made at the first reduce).
    assert peak <= shard_bytes + 2 * largest + 256 * 1024, (peak, shard_bytes, largest)
    if world > 1:
        assert peak < model_bytes, (peak, model_bytes)
    tokens = torch.randint(0, cfg.vocab, (2, SEQ))
    loss_fn(model(tokens), tokens).backward()  # the initialized model trains
    return {"peak": peak, "shard_bytes": shard_bytes, "model_bytes": model_bytes}


def check_load_full_state_dict() -> None:
    """Pretrained weights from rank 0 only (set_model_state_dict with broadcast_from_rank0),
    into a sharded model built on meta: every parameter equals the source."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    source = Decoder(Config())
    full = {k: v.clone() for k, v in source.state_dict().items()}
    with torch.device("meta"):
        model = Decoder(Config())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    given = dict(full) if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, given, options=options)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and isinstance(param.placements[0], RaggedShard)
        assert torch.equal(param.full_tensor(), full[name]), name
    tokens = torch.randint(0, Config().vocab, (2, SEQ))
    torch.testing.assert_close(model(tokens), source(tokens))
