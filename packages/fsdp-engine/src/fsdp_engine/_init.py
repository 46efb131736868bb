"""Group set-up for `fully_shard`: its argument checks, the parameters a call takes, the group."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from dbuffer import BlockFloat8, DBuffer, HostShard, splits_unevenly
from fsdp_engine._compat import parameter_slots, placement_result
from fsdp_engine._config import GroupConfig
from fsdp_engine._device import target_device
from fsdp_engine._gather_format import GatherFormatArg, resolve_gather_formats
from fsdp_engine._group import ParamGroup
from fsdp_engine._module import FSDPModule
from fsdp_engine._offload import host_shard_for
from fsdp_engine._param import Location, ManagedParam, ParallelSpec
from fsdp_engine._param_dtypes import OverrideFn, compute_dtypes, override_fn
from fsdp_engine._spmd import SpmdMesh
from fsdp_engine._state import FSDPState
from fsdp_engine._subclass import SubclassParam, gathers_itself
from ragged_placement import RaggedShard

BlockRowsArg = int | Mapping[str, int] | Callable[[str, nn.Parameter], int] | None
# Every parameter a group took, as given to fully_shard: id -> (weak reference, the group's
# label). A later call that meets one (a weight tied across groups) raises. By id, as tensors
# compare elementwise; weakly, so that a dropped model leaves nothing behind.
_MANAGED: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}


def _managed_by(param: nn.Parameter) -> str | None:
    """The label of the group that took `param`, if any."""
    entry = _MANAGED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _record_managed(param: nn.Parameter, label: str) -> None:
    key = id(param)
    _MANAGED[key] = (weakref.ref(param, lambda _: _MANAGED.pop(key, None)), label)


def init_state(
    modules: tuple[nn.Module, ...],
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    block_rows: BlockRowsArg,
    dp_mesh_dims: Any,
    gather_format: GatherFormatArg,
    param_dtype_override_fn: OverrideFn | None,
) -> FSDPState:
    """Checks `fully_shard`'s arguments, builds the group of `modules` and its state."""
    spmd = None if dp_mesh_dims is None else SpmdMesh.of(mesh, dp_mesh_dims)
    mesh = _resolve_mesh(mesh if spmd is None else spmd.dp_mesh)
    reshard: bool | int | None = _check_reshard_after_forward(reshard_after_forward)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    override = override_fn(mp_policy, param_dtype_override_fn)
    ignored = _check_ignored(ignored_params)
    found = _collect_params(modules, ignored)
    if spmd is not None:
        for param, fqn in found.names.items():
            found.take_spmd(param, fqn, spmd)
    placements = _resolve_placements(found, shard_placement_fn, mesh)
    rows = _resolve_block_rows(block_rows, found)
    formats = resolve_gather_formats(
        gather_format, found.names, rows, rows_given=block_rows is not None
    )
    label = type(modules[0]).__name__
    host = host_shard_for(offload_policy, label, formats, found.subclass.values())
    dtypes = compute_dtypes(mp_policy, override, found.names)
    group = _build_group(found, rows, formats, placements, mesh, mp_policy, label, dtypes, host)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        reshard = _post_forward_parts(group, reshard_after_forward, mesh)
    state = FSDPState(modules, group, GroupConfig(reshard_after_forward=reshard), mp_policy)
    state.spmd_typed = found.spmd_typed
    return state


# -- argument checks ---------------------------------------------------------------------------


def check_modules(module: object) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, list | tuple) else (module,)
    if not modules:
        raise ValueError("fully_shard needs a module or a non-empty list of modules")
    for mod in modules:
        if not isinstance(mod, nn.Module):
            raise TypeError(f"fully_shard takes nn.Modules, got {type(mod).__name__}")
        if isinstance(mod, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(mod).__name__}; apply it "
                f"once per module"
            )
    return modules


def _resolve_mesh(mesh: object) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    "fully_shard(mesh=None) needs torch.distributed initialized or torchrun's "
                    "environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
                )
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh must be 1-D (FSDP) or 2-D (replicate, shard) for HSDP, got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
        )
    return mesh


def _check_reshard_after_forward(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return True  # refined by _post_forward_parts once the group is built
    raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def _post_forward_parts(group: ParamGroup | None, parts: int, mesh: DeviceMesh) -> bool | int:
    """`reshard_after_forward=parts`: FSDP2's meaning (False for 1, True for the whole axis)."""
    world = mesh.size(mesh.ndim - 1)
    if parts < 1 or world % parts:
        raise ValueError(
            f"reshard_after_forward={parts} must divide the shard axis size {world}; valid: "
            f"True, False, None or one of {[k for k in range(1, world + 1) if world % k == 0]}"
        )
    if parts == 1:  # a world of one after forward: keep everything
        return False
    if parts == world or group is None:
        return True
    group.set_post_forward_parts(parts)
    return parts


def _check_ignored(ignored: object) -> set[nn.Parameter]:
    if ignored is None:
        return set()
    if not isinstance(ignored, set | frozenset | list | tuple):
        raise TypeError(f"ignored_params must be a set of parameters, got {type(ignored)}")
    return set(ignored)


# -- collecting parameters ---------------------------------------------------------------------


class _Found:
    """The parameters one call takes, in module order, with every place each is registered."""

    def __init__(self) -> None:
        self.names: dict[nn.Parameter, str] = {}
        # Tensor-subclass parameters with FSDP2's all-gather hooks: gathered by those.
        self.subclass: dict[nn.Parameter, str] = {}
        self.locations: dict[nn.Parameter, list[Location]] = {}
        # With dp_mesh_dims: what each DTensor parameter's DBuffer shards (its piece on the
        # non-data axes), and which axes of its mesh are data axes.
        self.inputs: dict[nn.Parameter, torch.Tensor] = {}
        self.data_axes: dict[nn.Parameter, tuple[int, ...]] = {}
        self.spmd_typed = False  # a plain parameter with spmd_types annotations was taken

    def take_spmd(self, param: nn.Parameter, fqn: str, spmd: SpmdMesh) -> None:
        """`param` on the full SPMD mesh `spmd`: what its DBuffer shards, its data axes."""
        self.inputs[param] = spmd.split(param, fqn)
        self.data_axes.pop(param, None)
        if isinstance(param, DTensor):
            self.data_axes[param] = spmd.data_axes
        else:  # a plain one with spmd_types annotations computes as one
            self.spmd_typed = True


def _collect_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]) -> _Found:
    found = _Found()
    for index, mod in enumerate(modules):
        prefix = f"{index}." if len(modules) > 1 else ""
        for sub_name, sub in _modules_outside_groups(mod):
            for attr, param in list(parameter_slots(sub).items()):
                if param is None or param in ignored:
                    continue
                fqn = prefix + (f"{sub_name}.{attr}" if sub_name else attr)
                owner = _managed_by(param)
                if owner is not None:
                    # A weight tied across groups (nested, or siblings such as an embedding
                    # and an output head sharded apart): two copies would drift apart.
                    raise ValueError(
                        f"parameter {fqn!r} is shared with a group already sharded by "
                        f"fully_shard on a {owner}; a parameter may belong to one "
                        f"group only: call fully_shard on a module that holds every use "
                        f"(e.g. [embedding, output] as one group, or their parent)"
                    )
                names = found.subclass if _check_param(fqn, param) else found.names
                if param not in names:
                    names[param] = fqn
                    found.locations[param] = []
                found.locations[param].append((sub, attr))
    return found


def _modules_outside_groups(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules (with their names) that no nested fully_shard call owns."""
    out: list[tuple[str, nn.Module]] = []

    def walk(name: str, module: nn.Module) -> None:
        out.append((name, module))
        for child_name, child in module.named_children():
            if isinstance(child, FSDPModule):
                continue
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", root)
    return out


def _check_param(fqn: str, param: nn.Parameter) -> bool:
    """Checks that fully_shard can take `param`; True if its class gathers it (`_subclass`)."""
    if param.dim() == 0:
        raise ValueError(
            f"parameter {fqn!r} is a scalar (0-d); fully_shard shards tensors with at least "
            f"one dim: make it shape (1,)"
        )
    data = param.data
    if isinstance(data, DTensor) and any(isinstance(p, RaggedShard) for p in data.placements):
        raise ValueError(
            f"parameter {fqn!r} is already sharded by fully_shard (a RaggedShard DTensor): "
            f"fully_shard ran on a module above this one first (call it bottom-up: each "
            f"block, then the root), or a weight was tied to a sharded parameter after "
            f"fully_shard (tie before it, and shard every use in one group)"
        )
    outer = type(data).__name__
    if isinstance(data, DTensor):  # tensor / expert parallel: DBuffer shards its local piece
        with torch.no_grad():
            data = data.to_local()
    if type(data) is not torch.Tensor:
        if outer == type(data).__name__ and gathers_itself(data):
            return True
        raise TypeError(
            f"parameter {fqn!r} is a {outer}"
            + (f" over a {type(data).__name__}" if outer != type(data).__name__ else "")
            + "; fully_shard takes plain tensors, DTensors over plain tensors (tensor or "
            "expert parallel), or tensor subclasses with FSDP2's fsdp_pre_all_gather / "
            "fsdp_post_all_gather hooks (e.g. torchao's NF4Tensor)"
        )
    if not data.is_contiguous():
        raise ValueError(
            f"parameter {fqn!r} is not contiguous (shape {tuple(data.shape)}, stride "
            f"{data.stride()}); make it contiguous before fully_shard"
        )
    return False


@dataclass(frozen=True)
class _Placement:
    """Where one parameter is sharded: how many leading dims may be cut, over which axes."""

    num_shard_dims: int
    mesh: DeviceMesh
    shard_axis: int
    replicate_axis: int | None


def _default_placement(mesh: DeviceMesh) -> _Placement:
    return _Placement(1, mesh, mesh.ndim - 1, 0 if mesh.ndim == 2 else None)


def _resolve_placements(
    found: _Found, shard_placement_fn: Callable[[nn.Parameter], Any] | None, mesh: DeviceMesh
) -> dict[nn.Parameter, _Placement]:
    default = _default_placement(mesh)
    if shard_placement_fn is None:
        return dict.fromkeys(found.names, default)
    if not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable, got {shard_placement_fn!r}")
    out: dict[nn.Parameter, _Placement] = {}
    for param, fqn in found.names.items():
        result: object = shard_placement_fn(param)  # user code: check what came back
        target = default
        on_own_mesh = placement_result(result)
        if on_own_mesh is not None:
            result, own_mesh, shard_axis, replicate_axis, full, dims = on_own_mesh
            if shard_axis is None:
                raise ValueError(
                    f"shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose "
                    f"mesh_info has no shard axis (DDP): fsdp_engine shards every parameter"
                )
            target = _Placement(1, own_mesh, shard_axis, replicate_axis)
            if full is not None:  # its own full SPMD mesh with its own data axes
                found.take_spmd(param, fqn, SpmdMesh.of(full, dims))
        if result is None:
            out[param] = target
            continue
        ndim = max(param.dim(), 1)
        if not isinstance(result, Shard) or not -ndim <= result.dim < ndim:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for {fqn!r} (shape "
                f"{tuple(param.shape)}); valid: None, Shard(d) with -{ndim} <= d < {ndim}, "
                f"or a ShardPlacementResult holding one of those"
            )
        cut = result.dim % ndim + 1
        out[param] = _Placement(cut, target.mesh, target.shard_axis, target.replicate_axis)
    return out


def _resolve_block_rows(block_rows: BlockRowsArg, found: _Found) -> dict[str, int]:
    names = {fqn: param for param, fqn in found.names.items()}
    if block_rows is None:
        return dict.fromkeys(names, 1)
    if isinstance(block_rows, Mapping):
        unknown = sorted(set(block_rows) - set(names))
        if unknown:
            shown = ", ".join(sorted(names)[:8])
            raise ValueError(
                f"block_rows names {unknown}, which are not parameters of this group; "
                f"valid: {shown}"
            )
        rows = {fqn: block_rows.get(fqn, 1) for fqn in names}
    elif isinstance(block_rows, int) and not isinstance(block_rows, bool):
        rows = dict.fromkeys(names, block_rows)
    elif callable(block_rows):
        rows = {fqn: block_rows(fqn, param) for fqn, param in names.items()}
    else:
        raise TypeError(
            f"block_rows must be an int, a mapping of FQN to int, or a function of (fqn, "
            f"param); got {type(block_rows).__name__}"
        )
    for fqn, given in rows.items():
        value: object = given  # user code: check what came back
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"block_rows for {fqn!r} must be an int >= 1, got {value!r}")
    return rows


# -- building the group ------------------------------------------------------------------------


def _build_group(
    found: _Found,
    rows: dict[str, int],
    formats: dict[str, BlockFloat8],
    placements: dict[nn.Parameter, _Placement],
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    label: str,
    dtypes: dict[nn.Parameter, torch.dtype | None],
    host: HostShard | None,
) -> ParamGroup | None:
    if not found.names and not found.subclass:
        return None
    device = target_device(found.names | found.subclass, mesh)
    # One DBuffer per (dtype, compute dtype, mesh and axes, gather format): experts on their
    # own mesh apart.
    by_buffer: dict[tuple[Any, ...], list[nn.Parameter]] = {}
    for param in found.names:
        where = placements[param]
        fmt = formats.get(found.names[param])
        axes = (id(where.mesh), where.shard_axis, where.replicate_axis)
        # A tensor split unevenly over its other axes is planned alone (dbuffer's rule).
        alone = id(param) if splits_unevenly(found.inputs.get(param, param)) else None
        key = (param.dtype, dtypes[param], *axes, fmt, alone)
        by_buffer.setdefault(key, []).append(param)
    buffers: dict[nn.Parameter, DBuffer] = {}
    for params in by_buffer.values():
        where = placements[params[0]]
        tensors = [(found.names[p], found.inputs.get(p, p).detach()) for p in params]
        if host is None:  # offloaded, the values go into the host shard from where they are
            tensors = [(name, t.to(device)) for name, t in tensors]
        buffer = DBuffer(
            tensors,
            where.mesh,
            shard_axis=where.shard_axis,
            replicate_axis=where.replicate_axis,
            block_rows={n: rows[n] for n, _ in tensors},
            gather_format=formats.get(tensors[0][0]),
            num_shard_dims={found.names[p]: placements[p].num_shard_dims for p in params},
            host_shard=host,
        )
        buffers.update(dict.fromkeys(params, buffer))
    managed = []
    for param, name in found.names.items():
        buffer = buffers[param]
        sharded = nn.Parameter(buffer.sharded(name), requires_grad=param.requires_grad)
        parallel = (
            ParallelSpec.of(param, found.data_axes.get(param, ()))
            if isinstance(param, DTensor)
            else None
        )
        managed.append(ManagedParam(name, found.locations[param], buffer, sharded, parallel))
    subclass_params = [
        SubclassParam.shard(name, found.locations[param], param, mesh, mp_policy, device)
        for param, name in found.subclass.items()
    ]
    group = ParamGroup(managed, mesh, mp_policy, label, subclass_params)
    group.compute_dtypes = {buffers[p]: dtype for p, dtype in dtypes.items()}
    for param in [*found.names, *found.subclass]:
        _record_managed(param, label)
    group.reshard()  # registers the sharded parameters
    return group
