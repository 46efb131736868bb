"""The schedule: output containers, the order it follows per iteration, its setters, errors."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from engine_support import (
    SEQ,
    assert_grads_equal,
    grads_of,
    sharded_model,
)
from model import Config, Decoder, loss_fn
from rank_pool import expect_error as _expect
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_engine import MixedPrecisionPolicy, fully_shard


@dataclasses.dataclass
class _DataclassOutput:
    loss: torch.Tensor
    hidden: torch.Tensor


class _DictOutput(dict):  # type: ignore[type-arg]
    """A dict subclass torch's pytree does not know."""


class _RegisteredOutput(OrderedDict):  # type: ignore[type-arg]
    """Like transformers' ModelOutput: an OrderedDict with attribute access, registered with
    torch's pytree (transformers registers every ModelOutput class)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


_OUTPUTS = {"dataclass": _DataclassOutput, "dict": _DictOutput, "registered": _RegisteredOutput}


class _Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Any:
        hidden = torch.tanh(self.lin(x))
        return _OUTPUTS[self.kind](loss=hidden.square().mean(), hidden=hidden)


class _TwoBlocks(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.first, self.second = _Block(kind), _Block(kind)

    def forward(self, x: torch.Tensor) -> Any:
        out = self.second(_hidden(self.first(x)))
        return type(out)(loss=_loss(out) + _loss(self.first(x)), hidden=_hidden(out))


def _hidden(out: Any) -> torch.Tensor:
    return out.hidden if isinstance(out, _DataclassOutput | _RegisteredOutput) else out["hidden"]


def _loss(out: Any) -> torch.Tensor:
    return out.loss if isinstance(out, _DataclassOutput | _RegisteredOutput) else out["loss"]


def check_output_containers(kind: str) -> None:
    """Module outputs that are dataclasses, dict subclasses or pytree-registered classes (what
    transformers' models return) keep their class, get their backward hooks (the gradients
    equal one process's), and keep it under no_grad with an output dtype."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    reference = _TwoBlocks(kind)
    model = copy.deepcopy(reference)
    for block in (model.first, model.second):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    out, expected = model(x), reference(x)
    assert type(out) is _OUTPUTS[kind] and type(model.first(x)) is _OUTPUTS[kind]
    torch.testing.assert_close(_loss(out), _loss(expected))
    _loss(out).backward()
    _loss(expected).backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad.full_tensor(), grads[name].grad, msg=name)
    policy = MixedPrecisionPolicy(output_dtype=torch.float64)
    cast = copy.deepcopy(reference).first
    fully_shard(cast, mesh=mesh, mp_policy=policy)
    with torch.no_grad():
        cast_out = cast(x)
    assert type(cast_out) is _OUTPUTS[kind] and _hidden(cast_out).dtype == torch.float64
    # Every module fully_shard manages carries the flag torch's fully_shard sets (transformers'
    # is_fsdp_managed_module, dynamo).
    assert all(m._is_fsdp_managed_module for m in model.modules())


class StageA(nn.Linear):
    pass


class StageB(nn.Linear):
    pass


class StageC(nn.Linear):
    pass


class _Routed(nn.Module):
    """Three stages whose order the caller chooses per forward (control flow that changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({"A": StageA(4, 4), "B": StageB(4, 4), "C": StageC(4, 4)})

    def forward(self, x: torch.Tensor, order: str) -> torch.Tensor:
        for name in order:
            x = torch.tanh(self.stages[name](x))
        return x


def check_schedule_follows_each_iteration() -> None:
    """The prefetch order is recorded every iteration (control flow may change), setters do
    not choose the root, and forward-only use records nothing that grows."""
    from torch.profiler import ProfilerActivity, profile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Routed()
    reference = copy.deepcopy(model)
    for stage in model.stages.values():
        fully_shard(stage, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Setters on a non-root before the first forward: the real root still becomes the root.
    model.stages["A"].set_reduce_scatter_max_input_buffers(2)
    model.stages["B"].set_is_last_backward(True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))

    def step(net: nn.Module, order: str) -> None:
        net(x, order).square().sum().backward()

    step(model, "ABC")
    step(model, "ACB")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, "ACB")
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    prefetched = {
        when: [
            e.name.split("(")[1].rstrip(")")
            for e in events
            if e.name.startswith(f"FSDP::{when}_prefetch(")
        ]
        for when in ("forward", "backward")
    }
    # Forward: each stage gathers the one that followed it in the previous forward (ACB);
    # backward (B, C, A): the one that finished forward just before it. The root holds no
    # parameters of its own, so it gathers nothing.
    assert prefetched["forward"] == ["StageC", "StageB"], prefetched
    assert prefetched["backward"] == ["StageC", "StageA"], prefetched
    # A module run twice in one forward: gathered again for each run's backward, reduced
    # after each (the gradients add up), never read while resharded.
    step(model, "ABAC")
    for order in ("ABC", "ACB", "ACB", "ABAC"):
        step(reference, order)
    for name, param in model.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(param.grad.full_tensor(), expected, msg=name)
    # An eval loop: nothing recorded per forward stays.
    context = model._fsdp_engine_state.context  # no public API shows the recorded order
    with torch.no_grad():
        for _ in range(50):
            model(x, "ABC")
    assert len(context.forward_order) == 3 and not context.post_forward_order, context


def _wait_for_reduce_in_post_backward(model: nn.Module, tokens: torch.Tensor) -> int:
    """Reduce waits inside groups' post-backward in one backward (the in-flight limit)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(model(tokens), tokens).backward()
    return sum(
        e.name.startswith("FSDP::wait_for_reduce")
        and e.cpu_parent is not None
        and e.cpu_parent.name.startswith("FSDP::post_backward")
        for e in prof.events()
    )


def check_schedule_setters() -> None:
    """The schedule setters change what is sharded when, and the gradients stay right."""
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, Config().vocab, (2, SEQ), generator=gen) for _ in range(2)]

    def backward(model: nn.Module, tokens: torch.Tensor) -> None:
        loss_fn(model(tokens), tokens).backward()

    reference, _ = sharded_model("ours", seed=0)
    for tokens in batches:  # two backwards, gradients accumulate
        backward(reference, tokens)
    expected = grads_of(reference)

    # reshard_after_forward / reshard_after_backward.
    model, _ = sharded_model("ours", seed=0)
    model.set_reshard_after_forward(False)
    logits = model(batches[0])
    assert not any(isinstance(p, DTensor) for p in model.layers[0].parameters())
    loss_fn(logits, batches[0]).backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model.set_reshard_after_forward(True)
    model.set_reshard_after_backward(False)
    backward(model, batches[1])
    assert not any(isinstance(p, DTensor) for p in model.layers[0].parameters())
    for module in (model, *model.layers):
        module.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert_grads_equal(grads_of(model), expected)

    # set_is_last_backward(False): the reduces finish when the next backward reduces.
    model, _ = sharded_model("ours", seed=0)
    model.set_is_last_backward(False)
    backward(model, batches[0])
    assert all(p.grad is None for p in model.parameters())
    model.set_is_last_backward(True)
    backward(model, batches[1])
    assert_grads_equal(grads_of(model), expected)

    # Zeroing some sharded gradients between backwards: those restart, the others add up.
    model, _ = sharded_model("ours", seed=0)
    backward(model, batches[0])
    first = grads_of(model)
    names = list(first)
    dropped = set(names[::2])
    for name, param in model.named_parameters():
        if name in dropped:
            param.grad = None
    backward(model, batches[1])
    single, _ = sharded_model("ours", seed=0)
    backward(single, batches[1])
    second_only = grads_of(single)
    mixed = {n: second_only[n] if n in dropped else expected[n] for n in names}
    assert_grads_equal(grads_of(model), mixed)
    assert all(not torch.equal(expected[n], second_only[n]) for n in dropped)

    # set_reduce_scatter_max_input_buffers: more reduces in flight, the same gradients; per
    # group, as `recurse` says (the root's own backward ends last, at the end of backward).
    model, _ = sharded_model("ours", seed=0)
    model.set_reduce_scatter_max_input_buffers(3, recurse=False)
    assert _wait_for_reduce_in_post_backward(model, batches[0]) == 1  # the blocks' limit is 1
    model.zero_grad()
    model.set_reduce_scatter_max_input_buffers(3)
    assert _wait_for_reduce_in_post_backward(model, batches[0]) == 0
    model.zero_grad()
    for tokens in batches:
        backward(model, tokens)
    assert_grads_equal(grads_of(model), expected)
    _expect(ValueError, lambda: model.set_reduce_scatter_max_input_buffers(0), "int >= 1")

    # set_unshard_in_backward(False) on an embedding: no gather in backward, same gradients.
    torch.manual_seed(0)
    model = Decoder(Config())
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.embed, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.embed.set_unshard_in_backward(False)
    from torch.profiler import ProfilerActivity, profile

    def embedding_gathers(fn: Callable[[], object]) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.name == "FSDP::unshard(Embedding)" for e in prof.events())

    outputs: list[torch.Tensor] = []
    for tokens in batches:
        assert embedding_gathers(lambda t=tokens: outputs.append(model(t))) == 1
        assert embedding_gathers(lambda t=tokens: loss_fn(outputs[-1], t).backward()) == 0
    assert_grads_equal(grads_of(model), expected)

    # reset_iter_state after an exception in the middle of forward.
    model, _ = sharded_model("ours", seed=0)

    def fail(*_: object) -> None:
        raise RuntimeError("boom")

    handle = model.layers[1].register_forward_hook(fail)
    _expect(RuntimeError, lambda: model(batches[0]), "boom")
    handle.remove()
    model.reset_iter_state()
    for tokens in batches:
        backward(model, tokens)
    assert_grads_equal(grads_of(model), expected)


def check_requires_all_reduce() -> None:
    """HSDP: set_requires_all_reduce(False) reduce-scatters only over the shard axis."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    tokens = torch.randint(
        0, Config().vocab, (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    results = []
    for all_reduce in (True, False):
        torch.manual_seed(0)
        model = Decoder(Config())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_requires_all_reduce(all_reduce)
        loss_fn(model(tokens), tokens).backward()
        results.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
    replicate = mesh.get_group("replicate")
    for name, without in results[1].items():
        averaged = without.clone()
        dist.all_reduce(averaged, group=replicate)
        torch.testing.assert_close(averaged / 2, results[0][name], msg=name)
        if without.numel():
            different = torch.tensor([float(not torch.allclose(without, results[0][name]))])
            dist.all_reduce(different)
            assert different.item() > 0, name  # the replicas' halves really differ


def check_training_states_after_errors() -> None:
    """A half-done iteration (an exception in forward or backward) is refused, not misrun.

    After `reset_iter_state()` training goes on and the gradients equal an untroubled run's.
    """
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, Config().vocab, (2, SEQ), generator=gen)
    reference, _ = sharded_model("ours", seed=0)
    loss_fn(reference(tokens), tokens).backward()
    expected = grads_of(reference)

    model, _ = sharded_model("ours", seed=0)

    def fail(*_: object) -> None:
        raise KeyError("injected")

    # An exception in backward (here a user's gradient hook) leaves groups mid-backward.
    out = model(tokens)
    out.register_hook(fail)
    _expect(KeyError, lambda: loss_fn(out, tokens).backward(), "injected")
    _expect(RuntimeError, lambda: model(tokens), "from pre_backward to forward")
    model.reset_iter_state()
    loss_fn(model(tokens), tokens).backward()
    assert_grads_equal(grads_of(model), expected)
    model.zero_grad()

    # An exception in forward (in the second block) leaves the root mid-forward; a backward
    # from what the first block returned must not hand out gradients as if it had finished.
    seen: list[torch.Tensor] = []

    def capture_and_fail(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(args[0])
        raise KeyError("injected")

    hook = model.layers[1].register_forward_pre_hook(capture_and_fail)
    _expect(KeyError, lambda: model(tokens), "injected")
    hook.remove()
    _expect(
        RuntimeError,
        lambda: seen[0].float().sum().backward(),
        "before its forward finished",
    )
    model.reset_iter_state()
    model.zero_grad()
    loss_fn(model(tokens), tokens).backward()
    assert_grads_equal(grads_of(model), expected)
