"""Tensor-subclass parameters, gathered through FSDP2's extension hooks (torchao's NF4Tensor).

A parameter whose class defines `fsdp_pre_all_gather` and `fsdp_post_all_gather` chooses what
crosses the wire: an NF4Tensor sends its 4-bit codes and its two levels of scales, not a
dense tensor of its dtype. Its local piece is such an object too (the subclass's own chunk
of rows), which a DBuffer (one flat tensor of one dtype, cut into views) cannot hold. So each
such parameter keeps FSDP2's layout: an even `Shard(0)` chunk per rank (the subclass cuts
it), a `DTensor` over that chunk between iterations, and at unshard one all-gather per tensor
its `fsdp_pre_all_gather` returns, into outputs of W times their size (no copy-in or
copy-out: each is sent as it is, as bytes), from which `fsdp_post_all_gather` builds the
full parameter.

What this costs against a parameter in a DBuffer: one collective per inner tensor per
gather (three for NF4) instead of a share of the group's one; whatever the subclass's hooks
compute (NF4's return views); no ragged layout: the rows must split evenly over the shard
axis, as the subclass's own chunking requires (NF4 checks that its blocks split too).

Only frozen parameters (`requires_grad=False`, QLoRA's base weights) are supported: the
engine gathers them but does not reduce gradients into a subclass's chunk.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer import Handle
from fsdp_engine._compat import all_gather_single
from fsdp_engine._param import Location, same_layout


def gathers_itself(data: torch.Tensor) -> bool:
    """Whether `data`'s class implements FSDP2's all-gather extension (both hooks).

    Raises:
        TypeError: It implements one hook without the other.
    """
    pre = hasattr(data, "fsdp_pre_all_gather")
    post = hasattr(data, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(
            f"{type(data).__name__} defines "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} without "
            f"{'fsdp_post_all_gather' if pre else 'fsdp_pre_all_gather'}: FSDP2's all-gather "
            f"extension needs both"
        )
    return pre


@dataclass(eq=False)
class SubclassParam:
    """One tensor-subclass parameter of a group (see the module docstring).

    Build it with `SubclassParam.shard`; the group gathers it with `unshard` (then `gathered`)
    and frees the gathered tensors with `reshard`.
    """

    name: str  # its FQN relative to the fully_shard module
    locations: list[Location]  # every (module, attribute) it is registered under
    sharded: nn.Parameter  # data: a DTensor (Shard(0), Replicate on an HSDP axis) over a chunk
    shard_mesh: DeviceMesh  # 1-D: the shard axis, as the subclass's hooks expect
    mp_policy: MixedPrecisionPolicy
    unsharded: nn.Parameter | None = None  # made at each unshard, dropped at reshard
    _outputs: list[torch.Tensor] | None = None
    _metadata: Any = None
    _mesh_only: bool | None = None  # fsdp_pre_all_gather's form (read once: inspect is slow)

    @classmethod
    def shard(
        cls,
        name: str,
        locations: list[Location],
        param: nn.Parameter,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
    ) -> SubclassParam:
        """Cuts this rank's chunk of rows (the subclass's `torch.chunk`) on `device`.

        The group's `mesh` is 1-D, or 2-D (replicate, shard) for HSDP: its last axis shards.

        Raises:
            NotImplementedError: `param` requires grad.
            ValueError: Its rows do not split evenly over the shard axis, the subclass cannot
                cut them, or an HSDP mesh has no axis names.
        """
        data = param.data
        if param.requires_grad:
            raise NotImplementedError(
                f"parameter {name!r} is a {type(data).__name__} with requires_grad=True: "
                f"fully_shard gathers tensor-subclass parameters through their "
                f"fsdp_pre/post_all_gather hooks but does not reduce gradients into them; "
                f"freeze it (param.requires_grad_(False), as QLoRA's base weights) or make "
                f"it a plain tensor"
            )
        shard_axis = mesh.ndim - 1
        shard_mesh = _axis_mesh(mesh, shard_axis, name)
        chunk = _chunk(name, data, shard_mesh, device)
        placements: list[Placement] = [Replicate()] * mesh.ndim
        placements[shard_axis] = Shard(0)
        local = DTensor.from_local(
            chunk, mesh, placements, run_check=False, shape=data.shape, stride=data.stride()
        )
        sharded = nn.Parameter(local, requires_grad=False)
        return cls(name, locations, sharded, shard_mesh, mp_policy)

    @property
    def local(self) -> torch.Tensor:
        """This rank's chunk: an instance of the subclass."""
        sharded = self.sharded
        assert isinstance(sharded, DTensor)
        return sharded.to_local()

    @property
    def is_unsharded(self) -> bool:
        return self._outputs is not None

    def unshard(self, *, async_op: bool) -> Handle:
        """Gathers what the subclass's `fsdp_pre_all_gather` returns, one tensor at a time."""
        local = self.local
        inputs, self._metadata = self._pre_all_gather(local)
        group = self.shard_mesh.get_group()
        size = self.shard_mesh.size()
        outputs, works = [], []
        for tensor in inputs:
            # As bytes: any dtype crosses any backend (gloo has no fp8 or 4-bit types).
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            out = torch.empty(size * flat.numel(), dtype=torch.uint8, device=flat.device)
            works.append(all_gather_single(out, flat, group=group, async_op=async_op))
            outputs.append(out.view(tensor.dtype).view(-1, *tensor.shape[1:]))
        self._outputs = outputs
        return Handle(works, device=local.device)

    def gathered(self) -> nn.Parameter:
        """The full parameter, built by the subclass's `fsdp_post_all_gather` (once per gather)."""
        if self.unsharded is None:
            assert self._outputs is not None, "unshard() first"
            local = self.local
            dtype = self.mp_policy.param_dtype or local.dtype
            made: Any = local.fsdp_post_all_gather(  # type: ignore[attr-defined]
                tuple(self._outputs), self._metadata, dtype
            )
            full = made[0]
            if full.shape != self.sharded.shape:
                raise RuntimeError(
                    f"{type(local).__name__}.fsdp_post_all_gather built {self.name!r} with "
                    f"shape {tuple(full.shape)}; the parameter is {tuple(self.sharded.shape)}"
                )
            self.unsharded = nn.Parameter(full, requires_grad=False)
        return self.unsharded

    def reshard(self) -> None:
        """Drops the gathered tensors (their memory goes with the last reference)."""
        self._outputs = None
        self._metadata = None
        self.unsharded = None

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Applies a device conversion to the chunk, keeping the subclass (`module.to()`)."""
        self.reshard()
        local = self.local
        with torch.no_grad():
            moved = fn(local)
        if type(moved) is not type(local):
            raise TypeError(
                f"converting {self.name!r} would turn its {type(local).__name__} chunk into "
                f"a {type(moved).__name__}; fully_shard keeps tensor-subclass parameters as "
                f"their class (move them to a device; change their dtype before fully_shard)"
            )
        self.adopt(self._wrap(moved))

    def adopt(self, new: object) -> None:
        """Takes `new` (what `load_state_dict(assign=True)` assigned) as the sharded parameter.

        `new` is a DTensor like the sharded parameter (what `model.state_dict()` gives), or
        the full tensor of the subclass (each rank keeps its chunk).

        Raises:
            ValueError: `new` is neither.
        """
        old = self.sharded
        assert isinstance(old, DTensor)
        kind = type(self.local)
        if isinstance(new, torch.Tensor) and type(new) is kind and new.shape == old.shape:
            new = self._wrap(_chunk(self.name, new.detach(), self.shard_mesh, new.device))
        if (
            not isinstance(new, DTensor)
            or type(new.to_local()) is not kind
            or not same_layout(new, old)
        ):
            raise ValueError(
                f"load_state_dict(assign=True) gives {self.name!r} a {type(new).__name__}; "
                f"it is sharded as a DTensor over a {kind.__name__} of shape "
                f"{tuple(old.shape)} with placements {tuple(old.placements)}: assign one "
                f"like it (model.state_dict() gives it) or the full {kind.__name__}, or "
                f"load with assign=False"
            )
        self.reshard()
        # The same parameter object stays registered (an optimizer or a user may hold it).
        torch.utils.swap_tensors(self.sharded, nn.Parameter(new, requires_grad=False))  # type: ignore[no-untyped-call]

    def _wrap(self, chunk: torch.Tensor) -> DTensor:
        old = self.sharded
        assert isinstance(old, DTensor)
        return DTensor.from_local(
            chunk,
            old.device_mesh,
            old.placements,
            run_check=False,
            shape=old.shape,
            stride=old.stride(),
        )

    def _pre_all_gather(self, local: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
        hook: Any = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        # FSDP2's two forms: (mesh), and (mesh, outer_size, outer_stride, module, mp_policy).
        if self._mesh_only is None:
            self._mesh_only = len(inspect.signature(hook).parameters) == 1
        if self._mesh_only:
            inputs, metadata = hook(self.shard_mesh)
        else:
            module = self.locations[0][0]
            sharded = self.sharded
            inputs, metadata = hook(
                self.shard_mesh, sharded.shape, sharded.stride(), module, self.mp_policy
            )
        return tuple(inputs), metadata


def _chunk(name: str, data: torch.Tensor, shard_mesh: DeviceMesh, device: torch.device) -> Any:
    """This rank's chunk of `data`'s rows, cut by its class (`torch.chunk`), on `device`."""
    size, rank = shard_mesh.size(), shard_mesh.get_local_rank()
    if data.shape[0] % size:
        raise ValueError(
            f"parameter {name!r} is a {type(data).__name__} of shape {tuple(data.shape)}: "
            f"its rows are gathered by its own hooks, which need them to split evenly "
            f"over the {size} ranks of the shard axis ({data.shape[0]} % {size} != 0)"
        )
    try:
        return torch.chunk(data, size, dim=0)[rank].to(device)
    except (AssertionError, NotImplementedError, RuntimeError) as err:
        raise ValueError(
            f"parameter {name!r} ({type(data).__name__} of shape {tuple(data.shape)}) "
            f"cannot be cut into {size} chunks of rows by its class: {err}"
        ) from err


def _axis_mesh(mesh: DeviceMesh, axis: int, name: str) -> DeviceMesh:
    """The 1-D mesh of `mesh`'s axis `axis`, which the subclass's hooks take."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"parameter {name!r} is gathered by its own hooks, which take the 1-D mesh of the "
            f"shard axis: give the {mesh.ndim}-D mesh axis names (init_device_mesh(..., "
            f"mesh_dim_names=('replicate', 'shard')))"
        )
    return mesh[names[axis]]
