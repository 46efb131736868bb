"""The state users save, copy, export and edit around training, on every rank of a RankPool.

A decoder under `fully_shard` (uneven RaggedShard pieces at W=3, empty ones for the small
tensors at W>=2) with each optimizer; the controls are torch's own AdamW on the same engine
and, for the round trips, the state before it was saved.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from model import Config, Decoder, loss_fn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from train import make_optimizer

from fsdp_engine import fully_shard

CONFIG = Config(vocab=96, dim=64, num_heads=4, num_layers=2, hidden=96)
BATCH_PER_RANK, SEQ = 2, 16


def _block_rows(fqn: str, param: torch.Tensor) -> int:
    return 32 if param.dim() == 2 else 1  # AdamW8bit's 32-row blocks stay whole


def sharded_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, block_rows=_block_rows)
    fully_shard(model, mesh=mesh, block_rows=_block_rows)
    return model


def optimizer_for(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return make_optimizer(name, model, 1e-2)


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    rows = dist.get_world_size() * BATCH_PER_RANK
    out = []
    for _ in range(steps):
        batch = torch.randint(0, CONFIG.vocab, (rows, SEQ), generator=gen)
        out.append(batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK])
    return out


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: list[torch.Tensor]) -> None:
    for tokens in steps:
        loss_fn(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def assert_same(got: Any, expected: Any, where: str = "") -> None:
    """Equal trees of dicts, lists and tensors; DTensors equal in placements and local piece."""
    if isinstance(expected, DTensor):
        assert isinstance(got, DTensor), (where, type(got))
    elif not isinstance(expected, dict | torch.Tensor):  # dict subclasses and Parameters too
        assert type(got) is type(expected), (where, type(got), type(expected))
    if isinstance(expected, dict):
        assert list(got) == list(expected), (where, list(got), list(expected))
        for key, value in expected.items():
            assert_same(got[key], value, f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, DTensor):
        assert got.placements == expected.placements, where
        assert got.shape == expected.shape, where
        assert torch.equal(got.to_local(), expected.to_local()), where
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    else:
        assert got == expected, (where, got, expected)


def _dtensors(tree: Any) -> list[DTensor]:
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _dtensors(value)]
    if isinstance(tree, list | tuple):
        return [t for value in tree for t in _dtensors(value)]
    return [tree] if isinstance(tree, DTensor) else []


def _saved(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only, torch's default


COPIES: dict[str, Callable[[Any], Any]] = {
    "torch.save": _saved,
    "pickle": lambda state: pickle.loads(pickle.dumps(state)),
    "deepcopy": copy.deepcopy,
}


def check_round_trips(optimizer: str) -> dict[str, int]:
    """Model and optimizer state dicts through torch.save, pickle and deepcopy: equal, each
    piece a tensor of its own, and loaded back the next step equals the uninterrupted one."""
    model = sharded_model()
    opt = optimizer_for(optimizer, model)
    steps = batches(3)
    train(model, opt, steps[:2])
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    sizes = {}
    for how, copy_of in COPIES.items():
        copied = copy_of(state)
        assert_same(copied, state, how)
        originals = {id(t.to_local().untyped_storage()) for t in _dtensors(state)}
        for piece in _dtensors(copied):
            local = piece.to_local()
            assert id(local.untyped_storage()) not in originals, how
            assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), how
    buffer = io.BytesIO()
    torch.save(state, buffer)
    sizes["saved_bytes"] = buffer.tell()
    sizes["piece_bytes"] = sum(
        t.to_local().numel() * t.to_local().element_size() for t in _dtensors(state)
    )
    buffer.seek(0)
    saved = torch.load(buffer)  # `state` holds live views: the next step changes them
    train(model, opt, steps[2:])
    after = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    buffer.seek(0)
    loaded = torch.load(buffer)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    assert_same({"model": model.state_dict(), "optim": opt.state_dict()}, saved, "loaded")
    train(model, opt, steps[2:])
    assert_same({"model": model.state_dict(), "optim": opt.state_dict()}, after, "resumed")
    return sizes


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, opt, options=options)
    return {"model": model_state, "optim": optim_state}


def check_full_state_equals_torch_adamw() -> int:
    """The flat AdamW's full optimizer state dict equals torch's AdamW's after the same steps."""
    ours, theirs = sharded_model(), sharded_model()
    ours_opt = optimizer_for("flat-adamw", ours)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    steps = batches(3)
    train(ours, ours_opt, steps)
    train(theirs, theirs_opt, steps)
    got, expected = full_state(ours, ours_opt), full_state(theirs, theirs_opt)
    if dist.get_rank() != 0:  # cpu_offload: full state dicts on rank 0 only
        assert got == {"model": {}, "optim": {}}, got
        return 0
    assert_same(got["model"], expected["model"], "full model")
    assert_same(got["optim"]["state"], expected["optim"]["state"], "full optim")  # by fqn
    return len(got["optim"]["state"])


def check_full_state_save(optimizer: str, path: str) -> None:
    """Trains 2 steps, saves the full state dicts from rank 0."""
    model = sharded_model()
    opt = optimizer_for(optimizer, model)
    train(model, opt, batches(2))
    state = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


def check_full_state_load(optimizer: str, path: str) -> int:
    """Loads the full state dicts into a model of another seed: its full state equals them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model = sharded_model(seed=5)
    opt = optimizer_for(optimizer, model)
    saved = torch.load(path)
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(
        model,
        opt,
        model_state_dict=saved["model"],
        optim_state_dict=saved["optim"],
        options=options,
    )
    got = full_state(model, opt)
    if dist.get_rank() != 0:
        return 0
    expected = torch.load(path)  # set_state_dict cut `saved` in place
    assert_same(got["model"], expected["model"], "reloaded model")
    assert_same(got["optim"]["state"], expected["optim"]["state"], "reloaded optim")
    return len(got["optim"]["state"])


def _moved(opt: torch.optim.Optimizer) -> None:
    for state in opt.state.values():
        for key, value in list(state.items()):
            state[key] = value.clone()


EDITS: dict[str, Callable[[torch.optim.Optimizer], None]] = {
    "moved": _moved,
    "cleared": lambda opt: opt.state.clear(),
    "halved": lambda opt: [
        entry.__setitem__("exp_avg", entry["exp_avg"] * 0.5) for entry in opt.state.values()
    ],
    "first cleared": lambda opt: next(iter(opt.state.values())).clear(),
}


def check_edits_follow_torch_adamw(edit: str) -> None:
    """An edit of the state between steps 2 and 3, made to the flat AdamW and torch's AdamW
    on two copies of one sharded model: parameters and state dicts equal after 3 more steps."""
    ours, theirs = sharded_model(), sharded_model()
    ours_opt = optimizer_for("flat-adamw", ours)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    steps = batches(5)
    for model, opt in ((ours, ours_opt), (theirs, theirs_opt)):
        train(model, opt, steps[:2])
        EDITS[edit](opt)
        train(model, opt, steps[2:])
    assert_same(ours.state_dict(), theirs.state_dict(), edit)
    got, expected = ours_opt.state_dict(), theirs_opt.state_dict()
    assert sorted(got["state"]) == sorted(expected["state"]), edit
    for index, state in expected["state"].items():
        assert_same(got["state"][index], state, f"{edit}/{index}")


def check_adamw8bit_edits() -> None:
    """AdamW8bit: state moved to copies steps on as if untouched; cleared, as a new AdamW8bit."""
    steps = batches(5)
    runs = {}
    for edit in ("none", "moved", "cleared"):
        model = sharded_model()
        opt = optimizer_for("adamw8bit", model)
        train(model, opt, steps[:2])
        if edit == "moved":
            _moved(opt)
        if edit == "cleared":
            opt.state.clear()
        train(model, opt, steps[2:])
        runs[edit] = (model.state_dict(), opt.state_dict())
    model = sharded_model()
    opt = optimizer_for("adamw8bit", model)
    train(model, opt, steps[:2])
    opt = optimizer_for("adamw8bit", model)  # a new optimizer: what a cleared state must equal
    train(model, opt, steps[2:])
    assert_same(runs["moved"], runs["none"], "moved")
    assert_same(runs["cleared"], (model.state_dict(), opt.state_dict()), "cleared")
