"""`clip_grad_norm_` for parameters on more than one mesh (data parallel beside tensor parallel).

torch's `clip_grad_norm_` stacks every gradient's norm into one tensor, which DTensor refuses
when the gradients live on different meshes: with tensor parallelism the blocks' weights are
DTensors over (dp, tp) while the norms or an untouched embedding are over dp alone (FSDP2 has
the same limit). Here the norm of each mesh's gradients is reduced to a plain tensor first
(`full_tensor()` of the partial norm: one all-reduce per mesh axis), then the per-mesh norms
are combined, and every gradient is scaled by the one clip coefficient. Under pipeline
parallelism each stage holds part of the model: `pp_mesh` combines the stages' norms too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


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
        foreach: Use torch's foreach kernels (None: where the device supports them).
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
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    mesh: object = pp_mesh  # callers may pass anything; check before use
    if mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim != 1):
        raise ValueError(f"pp_mesh must be a 1-D DeviceMesh or None, got {pp_mesh!r}")
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad and pp_mesh is None:
        return torch.tensor(0.0)
    by_mesh: dict[object, list[torch.Tensor]] = {}  # parameters by their gradient's mesh
    for param in with_grad:
        grad = param.grad
        key = grad.device_mesh if isinstance(grad, DTensor) else grad.device  # type: ignore[union-attr]
        by_mesh.setdefault(key, []).append(param)
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)  # type: ignore[arg-type]
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device if norms else torch.device(pp_mesh.device_type)  # type: ignore[union-attr]
    total = torch.nn.utils.get_total_norm(
        [n.to(device) for n in norms] or [torch.zeros((), device=device)],
        norm_type,
        error_if_nonfinite,
        foreach,
    )
    if pp_mesh is not None:
        total = _across_stages(total, float(norm_type), pp_mesh)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


def _across_stages(norm: torch.Tensor, norm_type: float, pp_mesh: DeviceMesh) -> torch.Tensor:
    """The p-norm over every stage, from each stage's p-norm."""
    group = pp_mesh.get_group()
    if math.isinf(norm_type):
        norm = norm.clone()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)
