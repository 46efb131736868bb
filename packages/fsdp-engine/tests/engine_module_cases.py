"""FSDPModule's methods on a sharded model, and the errors bad input gets."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from engine_support import (
    SEQ,
)
from model import Config, Decoder, loss_fn
from rank_pool import expect_error as _expect
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_engine
from fsdp_engine import fully_shard


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

    from dbuffer import BlockFloat8

    _expect(TypeError, lambda: fully_shard(fresh(), mesh=mesh, offload_policy="cpu"), "got 'cpu'")  # type: ignore[call-overload]
    # fp8 codes are made from the shard on the device; an offloaded shard is not there.
    fp8 = BlockFloat8(block=(1, 4))
    _expect(
        ValueError,
        lambda: fully_shard(
            nn.Sequential(nn.Linear(4, 4)),
            mesh=mesh,
            offload_policy=CPUOffloadPolicy(),
            gather_format=fp8,
        ),
        "fully_shard on Sequential: offload_policy=CPUOffloadPolicy(pin_memory=True) keeps "
        "the shards in host memory, but gather_format gathers '0.weight'",
    )
    _expect(ValueError, lambda: fsdp_engine.offload_within_budget([fresh()], -1), "got -1")
    _expect(TypeError, lambda: fsdp_engine.offload_within_budget(["m"], 1), "got str")
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
