"""Engine training checks run on every rank of a RankPool, against one process and FSDP2.

Each rank trains on its own slice of every batch; the reference trains one process on the full
batch, and torch's FSDP2 trains the same model on the same slices. After `steps` steps of
AdamW + clip_grad_norm_, the losses and every parameter must agree. Also here: the copies
and overlap a step makes, torch.compile, CUDA, and the docstring examples.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from engine_support import (
    full_params,
    make_batches,
    make_mesh,
    make_model,
    rows_of_rank,
    run_steps,
    sharded_model,
)
from low_precision import assert_as_accurate
from model import Config, Decoder, loss_fn
from profiling import engine_copies
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_engine
from fsdp_engine import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from ragged_placement import RaggedShard, flat_range

VARIANTS = (
    "dense",
    "sgd_foreach",
    "adamw_foreach",
    "moe",
    "block_rows",
    "list_group",
    "tied",
    "frozen",
    "unused",
    "explicit_prefetch",
    "grad_accumulation",
    "no_reshard",
    "hsdp",
    "bf16",
)


def _shard(model: Decoder, variant: str, engine: str, offload: bool = False) -> None:
    mesh = make_mesh(variant)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if offload:  # FSDP2 cannot pin without an accelerator; ours pins only for one
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=engine == "ours")
    if variant == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    shard: Callable[..., Any] = fully_shard if engine == "ours" else torch_fully_shard
    if variant == "block_rows" and engine == "ours":
        kwargs["block_rows"] = lambda fqn, p: 32 if p.dim() == 2 else 1
    if variant == "no_reshard":
        kwargs["reshard_after_forward"] = False
    for layer in model.layers:
        shard(layer, **kwargs)
    if variant == "list_group":
        shard([model.norm, model.head], **kwargs)
    kwargs.pop("reshard_after_forward", None)
    shard(model, **kwargs)
    if variant == "explicit_prefetch":
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])  # type: ignore[operator]
            layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i else [])  # type: ignore[operator]


def _train(
    model: nn.Module, batches: list[list[torch.Tensor]], variant: str, sharded: bool
) -> list[float]:
    # eps well above fp32 summation noise: AdamW's first step is g / (|g| + eps), so with
    # the default 1e-8 an element whose gradient is numerically zero (~1e-8, noise of the
    # reduction order) moves by up to lr / 2 depending on that noise (seen: 1.1e-4 on one
    # of 400 elements at W=4 with gradient accumulation, where the gradients agreed to 5e-10).
    if variant in ("sgd_foreach", "bf16"):  # bf16: linear in the gradient (low_precision)
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, foreach=variant == "sgd_foreach"
        )
    else:
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=1e-2,
            weight_decay=0.1,
            eps=1e-6,
            foreach=variant == "adamw_foreach",
        )
    losses = []
    for micro_batches in batches:
        total = 0.0
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            if sharded and len(micro_batches) > 1:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            tokens = rows_of_rank(batch, variant) if sharded else batch
            loss = loss_fn(model(tokens), tokens) / len(micro_batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if sharded:  # the mean over ranks is the full batch's loss
            value = torch.tensor(total, dtype=torch.float64)
            dist.all_reduce(value)
            total = value.item() / dist.get_world_size()
        losses.append(total)
    return losses


def _as_tensor(losses: list[float], model: nn.Module) -> torch.Tensor:
    """Losses in the model's dtype, so that assert_close uses that dtype's tolerances."""
    return torch.tensor(losses, dtype=next(model.parameters()).dtype)


def check_training(variant: str, steps: int = 5, offload: bool = False) -> dict[str, Any]:
    """Ours against the single-process reference (fp32) and against torch FSDP2.

    `offload`: both engines with `CPUOffloadPolicy` (on CPU the same memory: this checks that
    the offloaded path trains the same; `_check_offloaded` checks where the tensors are).
    """
    micro = 2 if variant == "grad_accumulation" else 1
    batches = make_batches(steps, micro)
    base = make_model(variant)
    reference_copy = copy.deepcopy(base)
    reference, theirs, ours = copy.deepcopy(base), copy.deepcopy(base), base
    _shard(ours, variant, "ours", offload)
    ours_losses = _train(ours, batches, variant, sharded=True)
    ours_params = full_params(ours)
    names = [name for name, _ in reference.named_parameters()]
    assert list(ours_params) == names, (list(ours_params), names)
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor), name
        assert isinstance(p.placements[-1], RaggedShard) or p.numel() == 0, (name, p.placements)
    if offload:
        _check_offloaded(ours)
    result: dict[str, Any] = {"ours": ours_losses}
    # bf16 is held against this fp32 run by accuracy, beside FSDP2's (below).
    ref_losses = _train(reference, batches, variant, sharded=False)
    ref_params = full_params(reference)
    result["reference"] = ref_losses
    if variant != "bf16":
        torch.testing.assert_close(_as_tensor(ours_losses, base), _as_tensor(ref_losses, base))
        for name, value in ref_params.items():
            torch.testing.assert_close(ours_params[name], value, msg=lambda m, n=name: f"{n}: {m}")
    # FSDP2 has no block granularity; before torch 2.13 it cannot give unused experts a zero
    # gradient (no set_reduce_scatter_unused_params), and without that its MoE reduce-scatters
    # mismatch across ranks: there the MoE case compares with one process only.
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    fsdp2_can = variant != "moe" or hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params")
    if variant != "block_rows" and fsdp2_can:
        if variant == "moe":
            # Ranks route tokens to different experts, so FSDP2 needs zero gradients for
            # the experts a rank did not use (or its reduce-scatters mismatch and hang);
            # that also gives experts no rank used a zero gradient where single-process
            # training has None. Compare with ours in the same mode.
            ours = copy.deepcopy(reference_copy)
            _shard(ours, variant, "ours", offload)
            ours.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
            ours_losses = _train(ours, batches, variant, sharded=True)
            ours_params = full_params(ours)
        _shard(theirs, variant, "fsdp2", offload)
        if variant == "moe":
            theirs.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        fsdp2_losses = _train(theirs, batches, variant, sharded=True)
        result["fsdp2"] = fsdp2_losses
        if variant == "bf16":
            losses = {"ours": ours_losses, "fsdp2": fsdp2_losses, "exact": ref_losses}
            as_dicts = {k: {"loss": torch.tensor(v)} for k, v in losses.items()}
            result["bf16 ratios"] = {  # our distance from fp32 over FSDP2's
                "losses": assert_as_accurate(
                    as_dicts["ours"], as_dicts["fsdp2"], as_dicts["exact"], what="losses"
                ),
                "params": assert_as_accurate(
                    ours_params, full_params(theirs), ref_params,
                    start=full_params(reference_copy), what="final parameters",
                ),
            }  # fmt: skip
            return result
        torch.testing.assert_close(_as_tensor(ours_losses, base), _as_tensor(fsdp2_losses, base))
        for name, value in full_params(theirs).items():
            torch.testing.assert_close(ours_params[name], value, msg=lambda m, n=name: f"{n}: {m}")
    return result


def _check_offloaded(model: nn.Module) -> None:
    """Every group of `model` keeps its shards in host memory and gathers through a copy."""
    from fsdp_engine._state import STATE_ATTR

    groups = [getattr(m, STATE_ATTR).group for m in model.modules() if hasattr(m, STATE_ATTR)]
    buffers = [b for group in groups if group is not None for b in group.buffers]
    assert buffers and all(b.host_shard is not None for b in buffers), buffers
    for buffer in buffers:
        assert buffer.local.device.type == "cpu" and not buffer.local.is_pinned()  # CPU mesh
        assert not buffer.has_local_grad or buffer.local_grad.device.type == "cpu"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.to_local().device.type == "cpu", name


def check_offload_within_budget() -> None:
    """A byte budget offloads exactly the groups it chose; training equals one process."""
    from fsdp_engine._state import STATE_ATTR

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.Linear(16, 8))
    blocks = [model[0], model[2], model[3]]  # 4,352, 4,160 and 544 bytes (fp32)
    chosen = fsdp_engine.offload_within_budget(blocks, max_bytes=5_000)
    assert chosen == [model[0], model[3]], chosen  # largest first, while it fits
    # In float64 from here: AdamW turns a gradient's rounding noise near zero into up to lr,
    # so fp32 could differ from one process by more than its tolerance; float64's noise can't.
    model.double()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        policy = CPUOffloadPolicy() if block in chosen else fsdp_engine.OffloadPolicy()
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh)
    for block in blocks:
        (buffer,) = getattr(block, STATE_ATTR).group.buffers
        assert (buffer.host_shard is not None) == (block in chosen), block
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, reference)]
    gen = torch.Generator().manual_seed(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    for _ in range(3):
        x = torch.randn(4 * world, 16, generator=gen, dtype=torch.float64)
        for net, opt, batch in (
            (model, opts[0], x[4 * rank : 4 * rank + 4]),
            (reference, opts[1], x),
        ):
            net(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, got), want in zip(full_params(model).items(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), msg=lambda m, n=name: f"{n}: {m}")


def check_block_rows_layout() -> None:
    """block_rows=32 on every 2-D weight: no rank boundary cuts a block of 32 rows."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Decoder(Config(dim=20, hidden=70, vocab=100))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh, block_rows=lambda fqn, p: 32 if p.dim() == 2 else 1)
    cut = 0
    for name, param in model.named_parameters():
        lo, hi = flat_range(param)
        if param.dim() != 2 or hi == lo:
            continue
        block = 32 * param.shape[1]
        assert lo % block == 0, (name, lo, hi)
        assert hi % block == 0 or hi == param.numel(), (name, lo, hi)
        cut += lo > 0
    # With more than one rank some 2-D weight really is split (the check above ran).
    counts = torch.tensor([cut])
    dist.all_reduce(counts)
    assert world == 1 or counts.item() > 0


def check_copies(engine: str) -> dict[str, Any]:
    """Copy kernels the engine runs in one training step (fp32), under the torch profiler."""
    model, opt = sharded_model(engine, seed=0)
    batches = [b[0] for b in make_batches(2, 1)]
    run_steps(model, opt, batches[:1])  # warm-up: lazy init, first allocations
    copies = engine_copies(lambda: run_steps(model, opt, batches[1:]))
    groups = fsdp_engine.sharding_summary(model) if engine == "ours" else []
    return {
        "kernels": {name: c.kernels for name, c in copies.items()},
        "bytes": {name: c.bytes for name, c in copies.items()},
        "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
        "num_params": sum(1 for _ in model.parameters()),
        "num_buffers": len(groups),
        "shard_bytes": sum(g.shard_numel * g.dtype.itemsize for g in groups),
        # Gathers per step: the root's (the first group) once, as it stays unsharded
        # through backward; the others' again in backward.
        "gathered_shard_bytes": sum(
            g.shard_numel * g.dtype.itemsize * (1 if index == 0 else 2)
            for index, g in enumerate(groups)
        ),
        "num_gathers": 2 * len(groups) - 1 if groups else 0,
    }


def check_compile(backend: str) -> None:
    """Each block compiled before fully_shard (as torchtitan does) trains as in eager mode."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    compiled = Decoder(Config())
    eager = copy.deepcopy(compiled)
    for index, layer in enumerate(compiled.layers):
        compiled.layers[index] = torch.compile(layer, backend=backend)
    for model in (compiled, eager):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled, eager)]
    for batch in make_batches(3, 1):
        tokens = rows_of_rank(batch[0], "dense")
        losses = []
        for model, opt in zip((compiled, eager), optimizers, strict=True):
            loss = loss_fn(model(tokens), tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
    eager_params = full_params(eager)
    for name, value in full_params(compiled).items():
        expected = eager_params[name.replace("._orig_mod", "")]
        if backend == "aot_eager":  # the same kernels: bit-exact
            assert torch.equal(value, expected), name
        else:  # inductor fuses differently
            torch.testing.assert_close(value, expected, msg=lambda m, n=name: f"{n}: {m}")


def check_overlap() -> dict[str, int]:
    """Collectives run while compute goes on (gloo works on its own threads).

    From the profiler's timeline of one training step on the training thread:
    - forward: the next block's all-gather is issued (`FSDP::forward_prefetch`) before this
      block's matmuls, which run before anything waits for a gather;
    - backward: a block's reduce-scatter is issued and the previous block's backward matmuls
      run before anything waits for a reduce.
    """
    from torch.profiler import ProfilerActivity, profile

    model, opt = sharded_model("ours", seed=0)
    batches = [b[0] for b in make_batches(2, 1)]
    run_steps(model, opt, batches[:1])  # the first step records the forward order
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(model, opt, batches[1:])
    events = [e for e in prof.events() if e.thread == _training_thread(prof.events())]
    events.sort(key=lambda e: e.time_range.start)

    def compute_between(start: str, parent: str, stop: str) -> int:
        """Matmuls after the first `start` event inside a `parent` range, before `stop`."""
        first = next(
            e
            for e in events
            if e.name.startswith(start) and e.cpu_parent and e.cpu_parent.name.startswith(parent)
        )
        later = [e for e in events if e.time_range.start >= first.time_range.end]
        end = next(e for e in later if e.name.startswith(stop)).time_range.start
        between = [e for e in later if e.time_range.start < end]
        return sum(e.name in ("aten::mm", "aten::addmm", "aten::bmm") for e in between)

    counts = {
        # Issued by block 0 for block 1; waited for in block 1's pre-forward.
        "forward": compute_between(
            "FSDP::forward_prefetch(Block)", "FSDP::pre_forward(Block)", "FSDP::wait_for_unshard"
        ),
        # Issued in block 1's post-backward; waited for in block 0's post-backward.
        "backward": compute_between(
            "FSDP::reduce_scatter(Block)", "FSDP::post_backward(Block)", "FSDP::wait_for_reduce"
        ),
    }
    # Backward visits the groups in reverse post-forward order, and the root finishes forward
    # last: its pre-backward prefetches the last block.
    counts["root_prefetch"] = sum(
        e.name == "FSDP::backward_prefetch(Block)"
        and e.cpu_parent is not None
        and e.cpu_parent.name.startswith("FSDP::pre_backward(")
        and "Block" not in e.cpu_parent.name
        for e in events
    )
    assert counts["forward"] > 0 and counts["backward"] > 0, counts
    assert counts["root_prefetch"] == 1, counts
    return counts


def _training_thread(events: Any) -> int:
    return next(e.thread for e in events if e.name.startswith("FSDP::pre_forward"))


def check_cuda_offload() -> dict[str, Any]:
    """CUDA: CPUOffloadPolicy keeps parameters, gradients and AdamW's state in pinned host
    memory between steps, trains as without offload, and peaks lower on the device."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world,))
    peaks, finals = {}, {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
        if not offload:
            model.to(device)  # offloaded: sharded from where it is (host memory)
        policy = CPUOffloadPolicy() if offload else fsdp_engine.OffloadPolicy()
        for layer in model:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            model(torch.randn(8, 1024, generator=gen).to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated()
        if offload:
            for name, param in model.named_parameters():
                local, grad = param.to_local(), param.grad.to_local()  # type: ignore[union-attr]
                assert local.device.type == "cpu" and local.is_pinned(), name
                assert grad.device.type == "cpu" and grad.is_pinned(), name
                for key, value in opt.state[param].items():
                    assert value.device.type == "cpu", (name, key)
        finals[offload] = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
        del model, opt
        torch.cuda.empty_cache()
    for name, value in finals[False].items():
        torch.testing.assert_close(finals[True][name], value, msg=lambda m, n=name: f"{n}: {m}")
    assert peaks[True] < peaks[False] / 2, peaks
    return {"peak_bytes": peaks}


def check_cuda_training() -> None:
    """CUDA + NCCL: ours equals single-process training; the root waits for a post-optim
    event recorded on a side stream where the optimizer runs."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    reference = Decoder(Config()).to(device)
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    side = torch.cuda.Stream()
    for batch in make_batches(3, 1):
        full = batch[0].to(device)
        loss_fn(model(rows_of_rank(full, "dense")), rows_of_rank(full, "dense")).backward()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt.step()
            opt.zero_grad()
            event = torch.cuda.Event()
            event.record(side)
        model.set_post_optim_event(event)  # the next forward's gathers wait for the step
        loss_fn(reference(full), full).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.cuda.current_stream().wait_stream(side)
    ref = full_params(reference)
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, ref[name], msg=lambda m, n=name: f"{n}: {m}")


def check_gradient_shards_released() -> None:
    """After zero_grad(), the next forward returns every gradient shard; held ones survive."""
    mesh = make_mesh("dense")
    model = make_model("dense")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    # No public API shows whether a gradient shard is allocated: the DBuffers' does.
    buffers = [b for s in (model, *model.layers) for b in s._fsdp_engine_state.group.buffers]
    batch = rows_of_rank(make_batches(1, 1)[0][0], "dense")

    def step(set_to_none: bool = True) -> None:
        loss_fn(model(batch), batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    step()
    assert all(b.has_local_grad for b in buffers)  # made by the reduce
    loss_fn(model(batch), batch).backward()
    held = model.layers[0].attn.wqkv.weight.grad
    expected = held.full_tensor().clone()
    opt.step()
    opt.zero_grad()
    model(batch)  # forward: nobody points at the shards any more, except `held`
    assert not any(b.has_local_grad for b in buffers)
    assert torch.equal(held.full_tensor(), expected)  # its memory stayed with it
    step(set_to_none=False)  # zeroed, not None: the shards stay in use
    model(batch)
    assert all(b.has_local_grad for b in buffers)


class Net(nn.Module):
    """What the docstring examples call `model`: two linear blocks and a `generate` method."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def _doctest_globs() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "torch": torch,
        "model": Net(),
        "fully_shard": fully_shard,
        "FSDPModule": fsdp_engine.FSDPModule,
    }


def check_doctests() -> dict[str, Any]:
    from doctest_support import run_doctests

    return run_doctests("fsdp_engine", _doctest_globs)
