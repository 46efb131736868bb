"""Engine checks run on every rank of a RankPool, against single-process training and FSDP2.

Each rank trains on its own slice of every batch; the reference trains one process on the full
batch, and torch's FSDP2 trains the same model on the same slices. After `steps` steps of
AdamW + clip_grad_norm_, the losses and every parameter must agree.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from low_precision import assert_as_accurate
from model import Config, Decoder, loss_fn
from profiling import engine_copies, peak_live_bytes
from rank_pool import expect_error as _expect
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_engine
from fsdp_engine import MixedPrecisionPolicy, fully_shard
from ragged_placement import RaggedShard, flat_range

BATCH_PER_RANK = 2
SEQ = 9

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


def _config(variant: str) -> Config:
    if variant == "moe":
        return Config(num_experts=16, top_k=2)
    if variant == "tied":
        return Config(tie_embeddings=True)
    return Config()


def _mesh(variant: str) -> DeviceMesh:
    world = dist.get_world_size()
    if variant == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _model(variant: str) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(_config(variant))
    if variant == "frozen":
        model.layers[0].attn_norm.weight.requires_grad_(False)
        model.norm.weight.requires_grad_(False)
    if variant == "unused":
        model.layers[1].unused = nn.Linear(3, 5)  # registered, never called
    if variant == "moe":
        # In float64: a top-2 router's near-ties flip on fp32 rounding noise (the order in
        # which ranks' gradients are summed), and one flipped token moves an expert far
        # beyond fp32 tolerances after a few steps (measured: 2.7e-4 at W=3). In float64
        # that noise is 1e-16 and the comparison is exact to float64's defaults.
        model.double()
    return model


def _shard(model: Decoder, variant: str, engine: str) -> None:
    mesh = _mesh(variant)
    kwargs: dict[str, Any] = {"mesh": mesh}
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


def _batches(steps: int, micro: int) -> list[list[torch.Tensor]]:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    vocab = Config().vocab
    return [
        [
            torch.randint(0, vocab, (world * BATCH_PER_RANK, SEQ), generator=gen)
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def _my_rows(batch: torch.Tensor, variant: str) -> torch.Tensor:
    rank = dist.get_rank()
    return batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]


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
            tokens = _my_rows(batch, variant) if sharded else batch
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


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }


def check_training(variant: str, steps: int = 5) -> dict[str, Any]:
    """Ours against the single-process reference (fp32) and against torch FSDP2."""
    micro = 2 if variant == "grad_accumulation" else 1
    batches = _batches(steps, micro)
    base = _model(variant)
    reference_copy = copy.deepcopy(base)
    reference, theirs, ours = copy.deepcopy(base), copy.deepcopy(base), base
    _shard(ours, variant, "ours")
    ours_losses = _train(ours, batches, variant, sharded=True)
    ours_params = _full_params(ours)
    names = [name for name, _ in reference.named_parameters()]
    assert list(ours_params) == names, (list(ours_params), names)
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor), name
        assert isinstance(p.placements[-1], RaggedShard) or p.numel() == 0, (name, p.placements)
    result: dict[str, Any] = {"ours": ours_losses}
    # bf16 is held against this fp32 run by accuracy, beside FSDP2's (below).
    ref_losses = _train(reference, batches, variant, sharded=False)
    ref_params = _full_params(reference)
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
            _shard(ours, variant, "ours")
            ours.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
            ours_losses = _train(ours, batches, variant, sharded=True)
            ours_params = _full_params(ours)
        _shard(theirs, variant, "fsdp2")
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
                    ours_params, _full_params(theirs), ref_params,
                    start=_full_params(reference_copy), what="final parameters",
                ),
            }  # fmt: skip
            return result
        torch.testing.assert_close(_as_tensor(ours_losses, base), _as_tensor(fsdp2_losses, base))
        for name, value in _full_params(theirs).items():
            torch.testing.assert_close(ours_params[name], value, msg=lambda m, n=name: f"{n}: {m}")
    return result


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


def check_fsdp_module_methods() -> None:
    """unshard / reshard / setters work as FSDP2's do."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Decoder(Config())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layer = model.layers[0]
    assert type(layer).__name__ == "FSDPBlock" and isinstance(layer, fsdp_engine.FSDPModule)
    assert type(model.layers[1]) is type(layer)  # one cached class per original class
    # unshard: the registered parameters become plain tensors equal to the full values.
    full = {n: p.full_tensor() for n, p in layer.named_parameters()}
    handle = layer.unshard(async_op=True)
    assert isinstance(handle, fsdp_engine.UnshardHandle)
    handle.wait()
    for name, param in layer.named_parameters():
        assert not isinstance(param, DTensor), name
        assert torch.equal(param, full[name]), name
    same = {n: p for n, p in layer.named_parameters()}
    layer.reshard()
    assert all(isinstance(p, DTensor) for p in layer.parameters())
    assert layer.unshard() is None
    assert all(p is same[n] for n, p in layer.named_parameters())  # persistent objects
    layer.reshard()
    # set_requires_gradient_sync(recurse): groups not synced hand out no gradient.
    tokens = torch.randint(
        0, 37, (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank())
    )

    def synced_after_backward() -> set[str]:
        loss_fn(model(tokens), tokens).backward()
        names = {n.split(".")[0] for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return names

    model.set_requires_gradient_sync(False)
    assert synced_after_backward() == set()
    model.set_requires_gradient_sync(True, recurse=False)
    assert synced_after_backward() == {"embed", "norm", "head"}  # the root's own group
    model.set_requires_gradient_sync(True)
    assert synced_after_backward() == {"embed", "norm", "head", "layers"}
    for name in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        _expect(NotImplementedError, lambda n=name: getattr(layer, n)(None), "does not support")
    _expect(NotImplementedError, layer.set_symm_mem_for_comm, "symmetric memory")
    _expect(NotImplementedError, lambda: layer.set_keep_unsharded_storage(True), "frees")
    _expect(NotImplementedError, lambda: layer._set_unshard_async_op(True), "current stream")
    _expect(NotImplementedError, layer._get_fsdp_state, "no torch FSDPState")
    _expect(
        NotImplementedError,
        lambda: layer.set_allocate_memory_from_process_group_for_comm(True),
        "DBuffer",
    )
    _expect(NotImplementedError, layer.set_separate_reduce_scatter_group, "process groups")
    # A forced sum divides once by the data-parallel size (the average); a divide factor
    # gives sum / factor.
    reference = _grads_after_backward(model, tokens)
    for sub in (model, *model.layers):
        sub.set_force_sum_reduction_for_comms(True)
    summed = _grads_after_backward(model, tokens)
    for name, grad in reference.items():
        torch.testing.assert_close(summed[name], grad, msg=name)
    for sub in (model, *model.layers):
        sub.set_force_sum_reduction_for_comms(False)
        sub.set_gradient_divide_factor(2.0)
    scaled = _grads_after_backward(model, tokens)
    for name, grad in reference.items():
        torch.testing.assert_close(scaled[name], grad * world / 2.0, msg=name)
    # set_all_reduce_hook sees each reduced flat shard of its own module's group only (not
    # recursive, as FSDP2's): on the root once per backward, on every module three times.
    seen: list[str] = []
    model.set_all_reduce_hook(lambda t: seen.append("root"))
    _grads_after_backward(model, tokens)
    assert seen == ["root"], seen
    for index, block in enumerate(model.layers):
        block.set_all_reduce_hook(lambda t, i=index: seen.append(f"layer {i}"))
    seen.clear()
    _grads_after_backward(model, tokens)
    assert sorted(seen) == ["layer 0", "layer 1", "root"], seen
    # Containers as FSDP2 has them: a slice of a sharded Sequential is a plain Sequential
    # over the same modules; deepcopy of a sharded module is refused, naming the fix.
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(seq, mesh=mesh)
    head = seq[0:2]
    assert type(head) is nn.Sequential and list(head) == list(seq)[:2], type(head)
    _expect(TypeError, lambda: copy.deepcopy(seq), "deepcopy the model before fully_shard")
    _expect(TypeError, lambda: copy.deepcopy(model), "deepcopy the model before fully_shard")
    # reset_iter_state, set_is_last_backward, set_reshard_after_* and unshard_in_backward.
    model.reset_iter_state()
    model.set_reshard_after_forward(False)  # check_schedule_setters: what it does
    model.set_reshard_after_backward(True)
    layer.set_unshard_in_backward(True)
    model.set_is_last_backward(True)


def _grads_after_backward(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    loss_fn(model(tokens), tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


def check_bad_input() -> None:
    """Every bad argument raises a clear error naming the value."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def fresh() -> Decoder:
        torch.manual_seed(0)
        return Decoder(Config())

    model = fresh()
    fully_shard(model.layers[0], mesh=mesh)
    _expect(ValueError, lambda: fully_shard(model.layers[0], mesh=mesh), "already applied")
    # A parameter tied across two groups.
    tied = Decoder(Config(tie_embeddings=True))
    fully_shard(tied.embed, mesh=mesh)
    _expect(ValueError, lambda: fully_shard(tied, mesh=mesh), "'head.weight' is shared")
    # A scalar parameter; parameters on mixed devices.
    scalar = nn.Linear(3, 3)
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    _expect(ValueError, lambda: fully_shard(scalar, mesh=mesh), "'scale' is a scalar")
    mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    _expect(ValueError, lambda: fully_shard(mixed, mesh=mesh), "one device")
    # Meshes: 3-D, not a mesh.
    if world == 1:
        cube = init_device_mesh("cpu", (1, 1, 1))
        _expect(ValueError, lambda: fully_shard(fresh(), mesh=cube), "3-D mesh")
    _expect(TypeError, lambda: fully_shard(fresh(), mesh="cpu"), "DeviceMesh")  # type: ignore[call-overload]
    # reshard_after_forward.
    _expect(ValueError, lambda: fully_shard(fresh(), mesh=mesh, reshard_after_forward=2), "=2")
    _expect(
        TypeError, lambda: fully_shard(fresh(), mesh=mesh, reshard_after_forward="yes"), "'yes'"
    )  # type: ignore[call-overload]
    # block_rows.
    _expect(
        ValueError,
        lambda: fully_shard(fresh(), mesh=mesh, block_rows={"head.wieght": 32}),
        "['head.wieght']",
    )
    _expect(ValueError, lambda: fully_shard(fresh(), mesh=mesh, block_rows=0), "got 0")
    _expect(
        ValueError,
        lambda: fully_shard(fresh(), mesh=mesh, block_rows={"head.weight": -4}),
        "'head.weight' must be an int >= 1, got -4",
    )
    _expect(TypeError, lambda: fully_shard(fresh(), mesh=mesh, block_rows=2.5), "float")  # type: ignore[call-overload]
    # shard_placement_fn.
    from torch.distributed.tensor import Shard

    _expect(
        ValueError,
        lambda: fully_shard(fresh(), mesh=mesh, shard_placement_fn=lambda p: Shard(1)),
        "returned Shard(dim=1)",
    )
    fully_shard(fresh(), mesh=mesh, shard_placement_fn=lambda p: Shard(0))  # the default: fine
    # Prefetch setters take FSDPModules only.
    layered = fresh()
    fully_shard(layered.layers[0], mesh=mesh)
    _expect(
        ValueError,
        lambda: layered.layers[0].set_modules_to_forward_prefetch([layered.layers[1]]),
        "must be FSDPModules",
    )
    _expect(
        ValueError,
        lambda: layered.layers[0].set_modules_to_backward_prefetch([nn.Linear(2, 2)]),
        "got Linear",
    )
    # Offload, policies, setters.
    from torch.distributed.fsdp import CPUOffloadPolicy

    _expect(
        NotImplementedError,
        lambda: fully_shard(fresh(), mesh=mesh, offload_policy=CPUOffloadPolicy()),
        "CPUOffloadPolicy",
    )
    _expect(
        TypeError, lambda: fully_shard(fresh(), mesh=mesh, mp_policy="bf16"), "MixedPrecisionPolicy"
    )  # type: ignore[call-overload]
    _expect(TypeError, lambda: layered.layers[0].set_requires_gradient_sync(1), "bool")
    _expect(ValueError, lambda: layered.layers[0].set_gradient_divide_factor(0), "> 0")
    _expect(TypeError, lambda: fully_shard(3, mesh=mesh), "nn.Modules")  # type: ignore[call-overload]
    _expect(TypeError, lambda: fsdp_engine.sharding_summary("model"), "nn.Module")  # type: ignore[arg-type]
    summary = fsdp_engine.sharding_summary(layered)
    assert sum(g.numel for g in summary) == sum(p.numel() for p in layered.layers[0].parameters())
    assert all(g.num_ranks == world and g.padding >= 0 for g in summary), summary
    _expect(
        ValueError, lambda: fsdp_engine.GroupSummary("m", torch.float32, 1, 10, 2, 4), "cannot hold"
    )
    # mesh=None: a 1-D mesh over the default process group.
    default = fully_shard(fresh())
    for param in default.parameters():
        assert param.device_mesh.ndim == 1 and param.device_mesh.size() == world
    _expect(ValueError, lambda: fully_shard([], mesh=mesh), "non-empty")


def _sharded_model(engine: str, seed: int) -> tuple[Decoder, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Decoder(Config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard: Callable[..., Any] = fully_shard if engine == "ours" else torch_fully_shard
    for layer in model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        tokens = _my_rows(batch, "dense")
        loss_fn(model(tokens), tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


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

    model, opt = _sharded_model(engine, seed=0)
    batches = [b[0] for b in _batches(4, 1)]
    _steps(model, opt, batches[:2])
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=f"{directory}/dcp")
    full = copy.deepcopy(full_state(model, opt))  # AdamW's step tensors are shared
    _steps(model, opt, batches[2:])
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

    model, opt = _sharded_model(engine, seed=123)
    storages = {n: p.to_local().untyped_storage().data_ptr() for n, p in model.named_parameters()}
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=f"{directory}/dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    if engine == "ours":  # still views of the DBuffer: the next gather sends the loaded values
        for name, param in model.named_parameters():
            assert param.to_local().untyped_storage().data_ptr() == storages[name], name
    expected = torch.load(f"{directory}/full.pt", weights_only=False)
    _assert_state_equal(full_state(model, opt), expected["saved"])
    if resume:
        batches = [b[0] for b in _batches(4, 1)]
        _steps(model, opt, batches[2:])
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


def check_meta_init() -> dict[str, int]:
    """Meta-device model -> fully_shard -> to_empty -> the model's own init: the parameters
    equal one process's init with the same seed, and the peak is about one shard (plus one
    full parameter at a time: a random fill draws the whole tensor on every rank)."""
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
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
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
    # The shard, one full parameter and its piece, and small temporaries (the gradient
    # shard is made at the first reduce).
    assert peak <= shard_bytes + 2 * largest + 256 * 1024, (peak, shard_bytes, largest)
    if world > 1:
        assert peak < model_bytes, (peak, model_bytes)
    tokens = torch.randint(0, cfg.vocab, (2, SEQ))
    loss_fn(model(tokens), tokens).backward()  # the initialized model trains
    return {"peak": peak, "shard_bytes": shard_bytes, "model_bytes": model_bytes}


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


torch.utils._pytree.register_pytree_node(
    _RegisteredOutput,
    lambda out: (list(out.values()), list(out.keys())),
    lambda values, keys: _RegisteredOutput(zip(keys, values, strict=True)),
)
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


def check_copies(engine: str) -> dict[str, Any]:
    """Copy kernels the engine runs in one training step (fp32), under the torch profiler."""
    model, opt = _sharded_model(engine, seed=0)
    batches = [b[0] for b in _batches(2, 1)]
    _steps(model, opt, batches[:1])  # warm-up: lazy init, first allocations
    copies = engine_copies(lambda: _steps(model, opt, batches[1:]))
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
    for batch in _batches(3, 1):
        tokens = _my_rows(batch[0], "dense")
        losses = []
        for model, opt in zip((compiled, eager), optimizers, strict=True):
            loss = loss_fn(model(tokens), tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
    eager_params = _full_params(eager)
    for name, value in _full_params(compiled).items():
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

    model, opt = _sharded_model("ours", seed=0)
    batches = [b[0] for b in _batches(2, 1)]
    _steps(model, opt, batches[:1])  # the first step records the forward order
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _steps(model, opt, batches[1:])
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


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


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

    reference, _ = _sharded_model("ours", seed=0)
    for tokens in batches:  # two backwards, gradients accumulate
        backward(reference, tokens)
    expected = _grads(reference)

    # reshard_after_forward / reshard_after_backward.
    model, _ = _sharded_model("ours", seed=0)
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
    _assert_grads_equal(_grads(model), expected)

    # set_is_last_backward(False): the reduces finish when the next backward reduces.
    model, _ = _sharded_model("ours", seed=0)
    model.set_is_last_backward(False)
    backward(model, batches[0])
    assert all(p.grad is None for p in model.parameters())
    model.set_is_last_backward(True)
    backward(model, batches[1])
    _assert_grads_equal(_grads(model), expected)

    # Zeroing some sharded gradients between backwards: those restart, the others add up.
    model, _ = _sharded_model("ours", seed=0)
    backward(model, batches[0])
    first = _grads(model)
    names = list(first)
    dropped = set(names[::2])
    for name, param in model.named_parameters():
        if name in dropped:
            param.grad = None
    backward(model, batches[1])
    single, _ = _sharded_model("ours", seed=0)
    backward(single, batches[1])
    second_only = _grads(single)
    mixed = {n: second_only[n] if n in dropped else expected[n] for n in names}
    _assert_grads_equal(_grads(model), mixed)
    assert all(not torch.equal(expected[n], second_only[n]) for n in dropped)

    # set_reduce_scatter_max_input_buffers: more reduces in flight, the same gradients; per
    # group, as `recurse` says (the root's own backward ends last, at the end of backward).
    model, _ = _sharded_model("ours", seed=0)
    model.set_reduce_scatter_max_input_buffers(3, recurse=False)
    assert _wait_for_reduce_in_post_backward(model, batches[0]) == 1  # the blocks' limit is 1
    model.zero_grad()
    model.set_reduce_scatter_max_input_buffers(3)
    assert _wait_for_reduce_in_post_backward(model, batches[0]) == 0
    model.zero_grad()
    for tokens in batches:
        backward(model, tokens)
    _assert_grads_equal(_grads(model), expected)
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
    _assert_grads_equal(_grads(model), expected)

    # reset_iter_state after an exception in the middle of forward.
    model, _ = _sharded_model("ours", seed=0)

    def fail(*_: object) -> None:
        raise RuntimeError("boom")

    handle = model.layers[1].register_forward_hook(fail)
    _expect(RuntimeError, lambda: model(batches[0]), "boom")
    handle.remove()
    model.reset_iter_state()
    for tokens in batches:
        backward(model, tokens)
    _assert_grads_equal(_grads(model), expected)


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


def _assert_grads_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")


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
    for batch in _batches(3, 1):
        full = batch[0].to(device)
        loss_fn(model(_my_rows(full, "dense")), _my_rows(full, "dense")).backward()
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
    ref = _full_params(reference)
    for name, value in _full_params(model).items():
        torch.testing.assert_close(value, ref[name], msg=lambda m, n=name: f"{n}: {m}")


# -- docstring examples ------------------------------------------------------------------------


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


def check_training_states_after_errors() -> None:
    """A half-done iteration (an exception in forward or backward) is refused, not misrun.

    After `reset_iter_state()` training goes on and the gradients equal an untroubled run's.
    """
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, Config().vocab, (2, SEQ), generator=gen)
    reference, _ = _sharded_model("ours", seed=0)
    loss_fn(reference(tokens), tokens).backward()
    expected = _grads(reference)

    model, _ = _sharded_model("ours", seed=0)

    def fail(*_: object) -> None:
        raise KeyError("injected")

    # An exception in backward (here a user's gradient hook) leaves groups mid-backward.
    out = model(tokens)
    out.register_hook(fail)
    _expect(KeyError, lambda: loss_fn(out, tokens).backward(), "injected")
    _expect(RuntimeError, lambda: model(tokens), "from pre_backward to forward")
    model.reset_iter_state()
    loss_fn(model(tokens), tokens).backward()
    _assert_grads_equal(_grads(model), expected)
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
    _assert_grads_equal(_grads(model), expected)


def check_gradient_shards_released() -> None:
    """After zero_grad(), the next forward returns every gradient shard; held ones survive."""
    mesh = _mesh("dense")
    model = _model("dense")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    # No public API shows whether a gradient shard is allocated: the DBuffers' does.
    buffers = [b for s in (model, *model.layers) for b in s._fsdp_engine_state.group.buffers]
    batch = _my_rows(_batches(1, 1)[0][0], "dense")

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
