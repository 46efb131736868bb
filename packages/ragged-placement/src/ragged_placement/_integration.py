"""The RaggedShard side of torch's DTensor entry points, installed by `_compat.install`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_placement._checkpoint import chunk_list, tensor_shard, write_items
from ragged_placement._compat import (
    DTensorSpec,
    OpArgs,
    OpCall,
    OpKwargs,
    OpSchema,
    OutputSharding,
    TensorMeta,
    contiguous_strides,
    local_of,
    make_dtensor,
    spec_of,
)
from ragged_placement._decisions import ShardingDecisions
from ragged_placement._foreach import foreach_ops, run
from ragged_placement._ops import RANDOM_FILLS, schema_has_ragged
from ragged_placement._placement import RaggedShard, StridedRaggedShard
from ragged_placement._redistribute import (
    block_shape,
    check_placements,
    ragged_ranges,
    redistribute_ragged,
    strided_axes,
    strided_chunk,
    unstrided,
)


class RaggedHooks:
    """Implements `_compat.Hooks`."""

    def __init__(self) -> None:
        self.decisions = ShardingDecisions()

    def is_ragged(self, placements: Sequence[Placement] | None) -> bool:
        return placements is not None and any(
            isinstance(p, RaggedShard | StridedRaggedShard) for p in placements
        )

    def schema_is_ragged(self, schema: OpSchema) -> bool:
        return schema_has_ragged(schema)

    redistribute = staticmethod(redistribute_ragged)

    def distribute(
        self,
        tensor: torch.Tensor,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        original: Callable[..., DTensor],
        src_data_rank: int | None,
    ) -> DTensor:
        if isinstance(tensor, DTensor):
            raise ValueError(
                "distribute_tensor with RaggedShard takes a torch.Tensor, got a DTensor"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                "RaggedShard shards the row-major flattening, so the source must be contiguous; "
                f"got shape {tuple(tensor.shape)} with stride {tensor.stride()}"
            )
        check_placements(placements, tensor.shape, tuple(mesh.shape))
        meta = TensorMeta(shape=tensor.shape, stride=tensor.stride(), dtype=tensor.dtype)
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
        # torch distributes the other axes (honouring src_data_rank; None = no communication)
        # and leaves the ragged axis whole; the ragged cut is then a local slice, the same
        # Replicate -> RaggedShard step redistribute takes (it clones: the piece must not
        # keep the whole block alive).
        plain = list(unstrided(spec).placements if strided_axes(placements) else placements)
        plain = [Replicate() if isinstance(p, RaggedShard) else p for p in plain]
        block = original(tensor, mesh, plain, src_data_rank=src_data_rank)
        local = redistribute_ragged(block.to_local(), spec_of(block), spec, original)
        requires_grad = tensor.requires_grad
        return make_dtensor(
            local.detach().requires_grad_(requires_grad), spec, requires_grad=requires_grad
        )

    def check_from_local(
        self,
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: torch.Size,
    ) -> None:
        check_placements(placements, shape, tuple(mesh.shape))
        meta = TensorMeta(shape, contiguous_strides(shape), local.dtype)
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
        if strided_axes(placements) is not None:
            lo, hi, _ = strided_chunk(spec)
            if local.dim() != 1 or local.numel() != hi - lo:
                raise ValueError(
                    f"the local tensor of {tuple(placements)} on this rank must be 1-D with "
                    f"{hi - lo} elements (its chunk of its piece), got shape {tuple(local.shape)}"
                )
            return
        for axis, p in enumerate(placements):
            if isinstance(p, RaggedShard):
                block = block_shape(spec, axis)
                lo, hi = ragged_ranges(spec, axis)[mesh.get_local_rank(axis)]
                if local.dim() != 1 or local.numel() != hi - lo:
                    raise ValueError(
                        f"the local tensor of {p!r} on this rank must be 1-D with {hi - lo} "
                        f"elements (range [{lo}, {hi}) of a block of shape {tuple(block)}), got "
                        f"shape {tuple(local.shape)}"
                    )

    def propagate(
        self, schema: OpSchema, tensor_meta: Callable[[OpSchema], Any], *, cacheable: bool
    ) -> OutputSharding:
        return self.decisions.decide(schema, tensor_meta, cacheable=cacheable)

    def checkpoint_write_items(self, dt: DTensor, fqn: str) -> list[Any]:
        return list(write_items(dt, fqn))

    def checkpoint_chunks(self, dt: DTensor) -> list[Any]:
        return list(chunk_list(dt))

    def checkpoint_shard(self, dt: DTensor, index: Any) -> torch.Tensor:
        return tensor_shard(dt, index)

    def random_fill(
        self, op: Any, dt: DTensor, args: Sequence[object], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        if op not in RANDOM_FILLS:
            return None
        local = local_of(dt)
        if local.is_meta:
            return local
        # Every rank draws the whole tensor (the same generator state everywhere, and the
        # same amount consumed): the values are one process's, whatever the world size.
        # Costs one full tensor of this parameter at a time.
        full = torch.empty(dt.shape, dtype=dt.dtype, device=local.device)
        op(full, *args, **kwargs)
        local.copy_(self._piece_of(full, dt))
        return local

    def load_full(self, dt: DTensor, full: torch.Tensor) -> DTensor:
        if tuple(full.shape) != tuple(dt.shape):
            raise ValueError(
                f"loading a full tensor of shape {tuple(full.shape)} into a DTensor of shape "
                f"{tuple(dt.shape)} ({dt.placements})"
            )
        local = local_of(dt)
        piece = self._piece_of(full.to(local.device), dt)
        if local.is_meta:
            return make_dtensor(piece.to(dt.dtype), spec_of(dt), requires_grad=False)
        local.copy_(piece)
        return dt

    def foreach_ops(self) -> list[Any]:
        return foreach_ops()

    def run_foreach(self, op: Any, args: OpArgs, kwargs: OpKwargs, fallback: OpCall) -> object:
        return run(op, args, kwargs, fallback)

    @staticmethod
    def _piece_of(full: torch.Tensor, dt: DTensor) -> torch.Tensor:
        """This rank's local piece of `full` under `dt`'s placements (no communication)."""
        piece = distribute_tensor(
            full.contiguous(), dt.device_mesh, dt.placements, src_data_rank=None
        )
        return local_of(piece)
