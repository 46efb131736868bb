"""`clip_grad_norm_` over gradients on any meshes, one norm per run of adjacent gradients.

torch's `clip_grad_norm_` takes one norm per gradient (a foreach kernel over N entries, and
for DTensors a partial norm each) and stacks them into one tensor, which DTensor refuses when
the gradients live on different meshes: with tensor parallelism the blocks' weights are
DTensors over (dp, tp) while the norms or an untouched embedding are over dp alone (FSDP2
has the same limit). Here the gradients are grouped by mesh and by which of its axes shard
them; in each group, gradients whose local pieces are adjacent in one storage (on
`fully_shard` a group's gradients are views of one flat shard) are one flat tensor
(`ragged_placement.flat_runs`), so a group of any size takes a norm per run. Each group's
local norm is reduced over the axes that shard it (one all-reduce per axis), the groups'
norms are combined, and every run is scaled by the one clip coefficient, as torch scales each
gradient. Under pipeline parallelism each stage holds part of the model: `pp_mesh` combines
the stages' norms too.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_engine._compat import foreach_mul_, foreach_norm
from fsdp_engine._norm_keys import is_partial_key, norm_keys
from ragged_placement import flat_runs, local_pieces


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clips the gradients' total norm to `max_norm`, as torch's, over gradients on any meshes.

    Args:
        parameters: Parameters (or one tensor) whose `.grad` is clipped in place.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm (`inf` for the largest absolute value).
        error_if_nonfinite: Raise if the total norm is nan or inf.
        foreach: Accepted for torch's signature; the norms and the scaling always run as
            foreach kernels over the flat runs (a few tensors, whatever the model).
        pp_mesh: The pipeline-parallel mesh axis when each rank holds one stage's parameters:
            the total norm is then over every stage's gradients (one all-reduce).

    Returns:
        The total norm of all gradients before clipping, a plain tensor (the same on every
        rank).

    Example:
        >>> from fsdp_engine import clip_grad_norm_
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> float(clip_grad_norm_(model.parameters(), max_norm=1e-3)) > 1e-3
        True
        >>> float(clip_grad_norm_(model.parameters(), max_norm=1e-3)) <= 1e-3 * (1 + 1e-5)
        True
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    value: object = max_norm  # callers may pass anything; check before use
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping), got {max_norm!r}")
    mesh: object = pp_mesh  # callers may pass anything; check before use
    if mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim != 1):
        raise ValueError(f"pp_mesh must be a 1-D DeviceMesh or None, got {pp_mesh!r}")
    found = [param.grad for param in params]
    grads: list[torch.Tensor] = [g for g in found if g is not None]
    if not grads and pp_mesh is None:
        return torch.tensor(0.0)
    p = float(norm_type)
    if math.isnan(p):
        raise ValueError(f"norm_type must be a number or inf, got {norm_type!r}")
    flats_by_group = _flat_groups(grads, whole=p == 0)
    if p == 0:  # torch's 0-"norm" of a list: how many gradients have a non-zero element
        norms = [_nonzero_tensors(pieces, axes) for (_, axes), pieces in flats_by_group.items()]
    else:
        norms = [
            _reduced_norm(_local_norm(flats, p), p, axes)
            for (_, axes), flats in flats_by_group.items()
        ]
    device = norms[0].device if norms else torch.device(pp_mesh.device_type)  # type: ignore[union-attr]
    total = _combined([n if n.device == device else n.to(device) for n in norms], p, device)
    if pp_mesh is not None:
        total = _reduce(total, p, [pp_mesh.get_group()])
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for flats in flats_by_group.values():
        for flat in flats:
            by_device.setdefault(flat.device, []).append(flat)
    for flat_device, flats in by_device.items():
        foreach_mul_(flats, coef if flat_device == coef.device else coef.to(flat_device))
    return total


_Groups = dict[tuple[torch.device, tuple[dist.ProcessGroup, ...]], list[torch.Tensor]]


def _flat_groups(grads: list[torch.Tensor], whole: bool = False) -> _Groups:
    """The gradients' local pieces as flat runs, by device and the groups that shard them.

    The process groups are those of the mesh axes that shard a gradient (none for a plain
    tensor or a replicated axis): its local norm is reduced over them. The entries come in
    the parameters' order, the same on every rank, so that their collectives pair up.
    `whole`: one piece per gradient instead of runs (what the 0-norm counts).

    Raises:
        ValueError: A gradient is Partial (a sum still pending over an axis), whose local
            norm is not a shard's.
    """
    keys = norm_keys(grads)
    if not keys:  # a pipeline stage without gradients
        return {}
    # Stretches of one norm key (keys compare by identity), found in C: a Python step per
    # stretch, not per gradient.
    changes = itertools.compress(range(1, len(keys)), map(operator.is_not, keys[1:], keys))
    bounds = [0, *changes, len(keys)]
    reduced_by: dict[int, tuple[torch.device, tuple[dist.ProcessGroup, ...]]] = {}
    groups: _Groups = {}  # in the order keys first appear
    for lo, hi in itertools.pairwise(bounds):
        key = keys[lo]
        where_by = reduced_by.get(id(key))
        if where_by is None:
            if is_partial_key(key):
                placements = getattr(grads[lo], "placements", None)
                raise ValueError(
                    f"clip_grad_norm_: gradient {lo} is a DTensor with placements "
                    f"{placements}: a Partial gradient's local piece is a summand, not a "
                    f"shard; reduce it first (grad.redistribute(placements=[Replicate() "
                    f"for Partial])) or clip before it becomes Partial"
                )
            where, axes = key
            over: tuple[dist.ProcessGroup, ...] = ()
            if isinstance(where, DeviceMesh):
                over = tuple(where.get_group(axis) for axis in axes)
            where_by = reduced_by[id(key)] = (grads[lo].device, over)
        # Runs of adjacent pieces within the stretch. In the parameters' order: `fully_shard`
        # lays a group's parameters out in that order, and a run that order cuts is still
        # right, only one more norm.
        pieces = local_pieces(grads[lo:hi]) if whole else [r.flat for r in flat_runs(grads[lo:hi])]
        groups.setdefault(where_by, []).extend(pieces)
    return groups


def _nonzero_tensors(
    pieces: list[torch.Tensor], groups: tuple[dist.ProcessGroup, ...]
) -> torch.Tensor:
    """How many of the gradients (one local piece each) have a non-zero element anywhere."""
    counts = torch.stack([torch.count_nonzero(piece) for piece in pieces]).double()
    for group in groups:
        counts = _all_reduce(counts, group)
    return (counts > 0).sum().to(pieces[0].dtype)


def _local_norm(flats: list[torch.Tensor], p: float) -> torch.Tensor:
    """The p-norm of this rank's pieces (0-d, in the gradients' dtype)."""
    return _combined(list(foreach_norm(flats, p)), p, flats[0].device)


def _reduced_norm(
    norm: torch.Tensor, p: float, groups: tuple[dist.ProcessGroup, ...]
) -> torch.Tensor:
    return _reduce(norm, p, list(groups)) if groups else norm


def _combined(norms: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """The p-norm of several p-norms (of disjoint sets of elements)."""
    if not norms:
        return torch.zeros((), device=device)
    if len(norms) == 1:  # the p-norm of one norm (>= 0) is that norm
        return norms[0]
    stacked = torch.stack(norms)
    total: torch.Tensor = stacked.sum() if p == 0 else torch.linalg.vector_norm(stacked, p)
    return total  # (a 0-norm counts non-zeros: counts add)


def _reduce(norm: torch.Tensor, p: float, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """The p-norm over every rank of `groups` (each in turn), from each rank's p-norm."""
    if math.isinf(p):
        norm = norm.clone()
        for group in groups:
            op = dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN
            norm = _all_reduce(norm, group, op)
        return norm
    powered = norm.double() if p == 0 else norm.double() ** p
    for group in groups:
        powered = _all_reduce(powered, group)
    total: torch.Tensor = (powered if p == 0 else powered ** (1.0 / p)).to(norm.dtype)
    return total


def _all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduces `tensor` in place, through the accelerator when its group is NCCL only.

    Gradients offloaded to host memory (`CPUOffloadPolicy`) have their norms there, and a
    group made for the accelerator's backend alone cannot reduce host tensors.
    """
    if tensor.device.type == "cpu" and dist.get_backend(group) == "nccl":
        on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=op, group=group)
        return tensor.copy_(on_device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor
