"""What frameworks that drive FSDP2 rely on, run on every rank of a RankPool.

torchft installs its cross-replica all-reduce with `set_all_reduce_hook` on the FSDP modules it
finds by `isinstance`; accelerate loads pretrained weights with `load_state_dict(assign=True)`
into a model sharded on the meta device; optimizer-in-backward registers post-accumulate-grad
hooks on the sharded parameters; and a weight tied across two sibling groups must be refused,
not silently untied. Each is checked against one process or plain HSDP.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from model import Config, Decoder, loss_fn
from rank_pool import expect_error
from side_by_side import steps_side_by_side
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_engine import fully_shard

SEQ = 9


def _tokens(seed: int, rows: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, Config().vocab, (rows, SEQ), generator=gen)


def _shard(model: Decoder, mesh: object) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _reference_and_sharded(mesh: object) -> tuple[Decoder, Decoder]:
    """A seeded decoder for one process, and its copy sharded per layer and at the root."""
    torch.manual_seed(0)
    reference = Decoder(Config())
    model = copy.deepcopy(reference)
    _shard(model, mesh)
    return reference, model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def check_all_reduce_hook_replaces_replicate_axis() -> None:
    """torchft-style HSDP: shard over one axis, the hook averages over the other.

    4 ranks as (replicate 2, shard 2). Plain HSDP on the 2-D mesh, against ours on the 1-D
    shard mesh with a hook, installed on every module that `isinstance(m, FSDPModule)` finds
    (as torchft walks the model), that all-reduces each reduced shard over the replicate group.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh["replicate"].get_group()
    torch.manual_seed(0)
    hsdp = Decoder(Config())
    hooked = copy.deepcopy(hsdp)
    _shard(hsdp, mesh)
    _shard(hooked, mesh["shard"])
    found = [m for m in hooked.modules() if isinstance(m, TorchFSDPModule)]
    assert len(found) == 1 + len(hooked.layers), found
    calls: list[int] = []

    def average_over_replicas(shard: torch.Tensor) -> None:
        calls.append(shard.numel())
        dist.all_reduce(shard, group=replicate)
        shard.div_(dist.get_world_size(replicate))

    for module in found:
        module.set_all_reduce_hook(average_over_replicas)
    tokens = _tokens(seed=dist.get_rank())
    for model in (hsdp, hooked):
        loss_fn(model(tokens), tokens).backward()
    assert len(calls) == len(found), calls  # once per group and backward, not recursively
    expected = _grads(hsdp)
    got = _grads(hooked)
    assert list(got) == list(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=name)


def check_post_accumulate_grad_hooks() -> None:
    """Hooks on sharded parameters run once per backward, with the sharded gradient set.

    Optimizer in backward: each hook steps its parameter alone and drops its gradient; the
    parameters after two steps equal those of an ordinary loop over the same steps.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = Decoder(Config())
    in_backward, ordinary = copy.deepcopy(base), base
    _shard(in_backward, mesh)
    _shard(ordinary, mesh)
    seen: list[str] = []
    optimizers = {}
    for name, param in in_backward.named_parameters():
        optimizers[param] = torch.optim.SGD([param], lr=0.1)

        def step(p: nn.Parameter, n: str = name) -> None:
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, n
            seen.append(n)
            optimizers[p].step()
            optimizers[p].zero_grad()

        param.register_post_accumulate_grad_hook(step)
    opt = torch.optim.SGD(ordinary.parameters(), lr=0.1)
    names = [n for n, _ in in_backward.named_parameters()]
    for seed in (1, 2):
        tokens = _tokens(seed=seed + 10 * dist.get_rank())
        seen.clear()
        loss_fn(in_backward(tokens), tokens).backward()
        assert sorted(seen) == sorted(names), seen  # every parameter, once
        assert all(p.grad is None for p in in_backward.parameters())
        loss_fn(ordinary(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    for (name, got), expected in zip(
        in_backward.named_parameters(), ordinary.parameters(), strict=True
    ):
        torch.testing.assert_close(got.full_tensor(), expected.full_tensor(), msg=name)


def check_load_state_dict_assign() -> None:
    """`load_state_dict(..., assign=True)` puts the given values in the sharded parameters.

    The accelerate way (`cpu_ram_efficient_loading`): a model built and sharded on the meta
    device, then each parameter's full weights distributed with the sharded parameter's own
    placements and assigned; and on a materialized model, DTensors or full tensors. The model
    then computes with the assigned values (its forward equals one process's), and a partial,
    mismatched or wrongly typed assignment raises.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    pretrained = Decoder(Config())
    full = {n: p.detach().clone() for n, p in pretrained.named_parameters()}
    tokens = _tokens(seed=3)
    expected = pretrained(tokens)
    # A meta-built model: the DTensors come from distribute_tensor with its placements.
    model, given = _meta_model_and_its_shards(mesh, full)
    model.load_state_dict(given, assign=True)
    for name, param in model.named_parameters():  # still the group's own sharded parameters
        assert isinstance(param, DTensor) and not param.to_local().is_meta, name
    torch.testing.assert_close(model(tokens), expected)
    # Full tensors on a materialized model (each rank keeps its rows).
    torch.manual_seed(1)
    other = Decoder(Config())
    _shard(other, mesh)
    other.load_state_dict(full, assign=True)
    torch.testing.assert_close(other(tokens), expected)
    loss_fn(other(tokens), tokens).backward()  # and it trains through the adopted values
    assert all(p.grad is not None for p in other.parameters())
    # Refusals: a different dtype, a DTensor of another layout, part of a meta group.
    wrong_dtype = {**full, "head.weight": full["head.weight"].double()}
    expect_error(ValueError, lambda: other.load_state_dict(wrong_dtype, assign=True), "float64")
    replicate = [torch.distributed.tensor.Replicate()]
    # A DTensor on the parameter's mesh with other placements is redistributed to its own.
    replicated = {**full, "head.weight": distribute_tensor(full["head.weight"], mesh, replicate)}
    other.load_state_dict(replicated, assign=True)
    torch.testing.assert_close(other(tokens), expected)
    flat = init_device_mesh("cpu", (1, dist.get_world_size()))  # another mesh: refused
    elsewhere = {**full, "head.weight": distribute_tensor(full["head.weight"], flat, replicate * 2)}
    expect_error(ValueError, lambda: other.load_state_dict(elsewhere, assign=True), "placements")
    partial, shards = _meta_model_and_its_shards(mesh, full)
    del shards["head.weight"]
    partial.load_state_dict(shards, assign=True, strict=False)
    expect_error(RuntimeError, lambda: partial(tokens), "head.weight")


def _meta_model_and_its_shards(
    mesh: object, full: dict[str, torch.Tensor]
) -> tuple[Decoder, dict[str, DTensor]]:
    """A model built and sharded on meta, and `full` distributed with its placements."""
    with torch.device("meta"):
        model = Decoder(Config())
    _shard(model, mesh)
    shards = {
        name: distribute_tensor(full[name], meta.device_mesh, meta.placements)
        for name, meta in model.state_dict().items()
    }
    return model, shards


def _hidden(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    x = model.embed(tokens)
    for layer in model.layers:
        x = layer(x)
    return model.norm(x)


class _HiddenDecoder(Decoder):
    """Its forward stops at the final norm: the loss runs the head (torchtitan's chunked loss)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _hidden(self, tokens)


def _chunked_loss_backward(model: Decoder, tokens: torch.Tensor, num_chunks: int) -> None:
    """Head and cross entropy per chunk of the sequence, a backward each, then the rest."""
    hidden = model(tokens)
    detached = hidden.detach().requires_grad_()
    targets = tokens[:, 1:]
    bounds = torch.linspace(0, targets.shape[1], num_chunks + 1).long().tolist()
    for lo, hi in itertools.pairwise(bounds):
        logits = model.head(detached[:, lo:hi])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets[:, lo:hi].reshape(-1), reduction="sum"
        )
        (loss / targets.numel()).backward()
    hidden.backward(detached.grad)


def check_chunked_loss_list_group() -> None:
    """`fully_shard([norm, head])` with the head run per chunk outside forward: as one process.

    Each chunk's backward reduces the head's gradients (added to the previous chunks'); the
    last backward, through the forward's output, reduces the rest. Forgetting that last
    backward is refused at the next forward.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = _HiddenDecoder(Config())
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        batch = torch.randint(0, Config().vocab, (world, SEQ), generator=gen)
        _chunked_loss_backward(model, batch[rank : rank + 1], num_chunks=3)
        for param in model.parameters():
            assert isinstance(param.grad, DTensor)
        opt.step()
        opt.zero_grad()
        _chunked_loss_backward(reference, batch, num_chunks=3)
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), expected.detach(), msg=name)
    tokens = _tokens(seed=5, rows=1)
    detached = model(tokens).detach().requires_grad_()
    model.head(detached).sum().backward()
    expect_error(RuntimeError, lambda: model(tokens), "no backward pass reached the root's")


def check_loss_from_an_inner_output() -> None:
    """A loss on a block's output caught by a hook (the root's output unused): as one process."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reference, model = _reference_and_sharded(init_device_mesh("cpu", (world,)))
    caught: dict[nn.Module, torch.Tensor] = {}

    def catch(block: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        caught[block] = output

    for m in (model, reference):
        m.layers[0].register_forward_hook(catch)
    batch = _tokens(seed=8, rows=world)
    for m, rows in ((model, batch[rank : rank + 1]), (reference, batch)):
        m(rows)
        caught[m.layers[0]].pow(2).mean().backward()
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        if expected.grad is None:
            assert got.grad is None, name
            continue
        torch.testing.assert_close(got.grad.full_tensor(), expected.grad, msg=name)


def check_fused_optimizers() -> None:
    """torch's fused AdamW (torchtitan's default) and SGD step the sharded parameters.

    Each equals its foreach form on the same sharded model (states too), and AdamW equals
    one process on the whole batch. Fused and foreach kernels round differently, so the
    comparisons allow float32 rounding (assert_close's defaults).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = Decoder(Config())
    makers = {
        "adamw": lambda ps, **how: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **how),
        "sgd": lambda ps, **how: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **how),
    }
    for name, make in makers.items():
        fused, foreach = copy.deepcopy(reference), copy.deepcopy(reference)
        _shard(fused, mesh)
        _shard(foreach, mesh)
        opts = {"fused": make(fused.parameters(), fused=True)}
        opts["foreach"] = make(foreach.parameters(), foreach=True)
        one = copy.deepcopy(reference)
        gen = torch.Generator().manual_seed(6)
        batches = [torch.randint(0, Config().vocab, (world, SEQ), generator=gen) for _ in range(3)]
        steps_side_by_side(
            [(fused, opts["fused"]), (foreach, opts["foreach"])],
            (one, make(one.parameters(), fused=True)),
            batches,
            rank,
            loss_fn,
        )
        params = zip(fused.named_parameters(), foreach.parameters(), one.parameters(), strict=True)
        for (pname, got), other, expected in params:
            msg = f"{name} {pname}"
            torch.testing.assert_close(got.full_tensor(), other.full_tensor(), msg=msg)
            torch.testing.assert_close(got.full_tensor(), expected.detach(), msg=msg)
            for key, state in opts["fused"].state[got].items():
                if isinstance(state, DTensor):
                    twin = opts["foreach"].state[other][key]
                    torch.testing.assert_close(state.full_tensor(), twin.full_tensor(), msg=msg)


def check_grad_scaler() -> None:
    """`torch.amp.GradScaler` on the sharded gradients, as with FSDP2.

    Three scaled steps against one process with its own scaler; at step 1 an inf lands in a
    single element of rank 0's gradient shard only (and in the reference's same element):
    every rank must find it and skip that step (a rank that stepped would diverge silently),
    and the scale backs off the same everywhere.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    reference, model = _reference_and_sharded(init_device_mesh("cpu", (world,)))
    runs = []
    for net in (model, reference):
        runs.append((net, torch.optim.SGD(net.parameters(), lr=0.1), torch.amp.GradScaler("cpu")))
    for step in range(3):
        tokens = _tokens(20 + step, rows=world)
        for net, opt, scaler in runs:
            batch = tokens[rank : rank + 1] if net is model else tokens  # mean loss: the same
            scaler.scale(loss_fn(net(batch), batch)).backward()
            if step == 1:
                grad = net.embed.weight.grad
                if net is reference:
                    grad.view(-1)[0] = float("inf")
                elif rank == 0:  # the first element of the flat weight: rank 0's shard
                    grad.to_local().view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in net.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            moved = [
                not torch.equal(a, p.detach())
                for a, p in zip(before, net.parameters(), strict=True)
            ]
            assert any(moved) == (step != 1), (step, rank, moved)
        scales = [scaler.get_scale() for *_, scaler in runs]
        assert scales[0] == scales[1] and (step != 1 or scales[0] < 2.0**16), (step, scales)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), expected.detach(), msg=name)


def check_tied_across_sibling_groups_is_refused() -> None:
    """An embedding tied to the output head, each sharded on its own: refused, named."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Decoder(Config(tie_embeddings=True))
    assert model.embed.weight is model.head.weight
    fully_shard(model.embed, mesh=mesh)
    expect_error(ValueError, lambda: fully_shard(model.head, mesh=mesh), "'weight' is shared")
    # One group holding both uses trains as one tied weight.
    tied = Decoder(Config(tie_embeddings=True))
    fully_shard([tied.embed, tied.head], mesh=mesh)
    fully_shard(tied, mesh=mesh)
    tokens = _tokens(seed=dist.get_rank())
    loss_fn(tied(tokens), tokens).backward()
    assert tied.embed.weight is tied.head.weight and tied.head.weight.grad is not None
