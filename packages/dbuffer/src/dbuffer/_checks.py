"""Input checks of DBuffer's public boundary: each error names the value and what is valid."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from shard_planner import Layout, TensorSpec

# One contract with fully_shard's `block_rows` (fqn, param): a function of (name, tensor).
BlockRows = int | Mapping[str, int] | Callable[[str, torch.Tensor], int]


def _takes_shape(fn: Callable[..., int]) -> bool:
    """Whether `fn` is the deprecated (name, shape) form: its second parameter is `shape`."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: the current form
        return False
    return len(params) >= 2 and params[1] == "shape"


def block_rows_by_name(
    block_rows: BlockRows, tensors: Sequence[tuple[str, torch.Tensor]]
) -> dict[str, int]:
    """Each tensor's rows per block (values are checked where the specs are built).

    `tensors` are what the caller gave (a DTensor entry as given, not its local piece).
    """
    names = [name for name, _ in tensors]
    if isinstance(block_rows, int):
        return dict.fromkeys(names, block_rows)
    if isinstance(block_rows, Mapping):
        unknown = sorted(set(block_rows) - set(names))
        if unknown:
            raise ValueError(f"block_rows names tensors that are not in the DBuffer: {unknown}")
        return {name: block_rows.get(name, 1) for name in names}
    if callable(block_rows):
        if _takes_shape(block_rows):
            warnings.warn(
                "DBuffer(block_rows=f) with f(name, shape) is deprecated: f now takes "
                "(name, tensor), as fully_shard's block_rows takes (fqn, param)",
                DeprecationWarning,
                4,  # this, plan_entries, DBuffer.__init__: the caller's line
            )
            return {name: block_rows(name, t.shape) for name, t in tensors}  # type: ignore[arg-type]
        return {name: block_rows(name, t) for name, t in tensors}
    raise TypeError(
        f"block_rows must be an int, a mapping of name to int, or a function of (name, "
        f"tensor); got {type(block_rows).__name__}"
    )


def check_num_shard_dims(
    num_shard_dims: object, tensors: Sequence[tuple[str, torch.Tensor]]
) -> dict[str, int]:
    """Each tensor's count of cuttable leading dims, in [1, max(ndim, 1)]."""
    shapes = {name: t.shape for name, t in tensors}
    if isinstance(num_shard_dims, Mapping):
        unknown = sorted(set(num_shard_dims) - set(shapes))
        if unknown:
            raise ValueError(f"num_shard_dims names tensors that are not in the DBuffer: {unknown}")
        given = {name: num_shard_dims.get(name, 1) for name in shapes}
    elif isinstance(num_shard_dims, int) and not isinstance(num_shard_dims, bool):
        given = dict.fromkeys(shapes, num_shard_dims)
    else:
        raise TypeError(
            f"num_shard_dims must be an int or a mapping of name to int, got "
            f"{type(num_shard_dims).__name__}"
        )
    for name, value in given.items():
        count: object = value  # user input: check what came
        top = max(len(shapes[name]), 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= top:
            raise ValueError(
                f"num_shard_dims for DBuffer tensor {name!r} (shape {tuple(shapes[name])}) "
                f"must be an int in [1, {top}], got {count!r}"
            )
    return given


def check_dtype(what: str, dtype: object) -> torch.dtype | None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype or None, got {dtype!r}")
    return dtype


def check_axis(what: str, axis: object, mesh: DeviceMesh) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < mesh.ndim:
        raise ValueError(f"{what} must be a mesh axis in [0, {mesh.ndim}), got {axis!r}")
    return axis


def check_tensors(tensors: Sequence[tuple[str, object]]) -> None:
    if not tensors:
        raise ValueError("DBuffer needs at least one (name, tensor) pair")
    seen: set[str] = set()
    first: torch.Tensor | None = None
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"DBuffer tensor {name!r} must be a torch.Tensor or a DTensor, got "
                f"{type(t).__name__}"
            )
        if name in seen:
            raise ValueError(f"DBuffer tensor names must be unique, {name!r} repeats")
        seen.add(name)
        first = first if first is not None else t
        if not t.is_contiguous():
            raise ValueError(
                f"DBuffer tensor {name!r} must be contiguous (shape {tuple(t.shape)}, "
                f"stride {t.stride()})"
            )
        if t.dtype != first.dtype:
            raise ValueError(
                f"DBuffer tensors must share one dtype: {name!r} is {t.dtype}, "
                f"{tensors[0][0]!r} is {first.dtype}; make one DBuffer per dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"DBuffer tensors must share one device: {name!r} is on {t.device}, "
                f"{tensors[0][0]!r} on {first.device}"
            )


def check_layout(layout: Layout, specs: list[TensorSpec], world: int) -> None:
    if layout.world_size != world:
        raise ValueError(
            f"layout is for world size {layout.world_size}, the shard axis has {world}"
        )
    planned = {s.name: s.numel for s in layout.tensors}
    given = {s.name: s.numel for s in specs}
    if planned != given:
        missing = sorted(set(given) - set(planned))
        extra = sorted(set(planned) - set(given))
        wrong = sorted(n for n in set(given) & set(planned) if given[n] != planned[n])
        raise ValueError(
            f"layout does not match the tensors: missing {missing}, unexpected {extra}, "
            f"different sizes {wrong}"
        )
    layout.validate()


def check_align_bytes(align_bytes: object, itemsize: int) -> int:
    """`align_bytes` in elements of `itemsize` bytes."""
    if (
        isinstance(align_bytes, bool)
        or not isinstance(align_bytes, int)
        or align_bytes < 1
        or align_bytes % itemsize
    ):
        raise ValueError(
            f"align_bytes must be a positive multiple of the itemsize {itemsize}, "
            f"got {align_bytes!r}"
        )
    return align_bytes // itemsize


def check_grad(name: str, grad: object, shape: torch.Size, device: torch.device) -> None:
    """A full gradient for tensor `name`: a floating tensor of its shape, on the buffer's device."""
    if not isinstance(grad, torch.Tensor) or grad.shape != shape:
        got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise ValueError(
            f"accumulate_grad({name!r}): expected a tensor of shape {tuple(shape)}, got {got}"
        )
    if grad.device != device:
        raise ValueError(
            f"accumulate_grad({name!r}): gradient on {grad.device}, buffer on {device}"
        )
    if not (grad.is_floating_point() or grad.is_complex()):
        raise TypeError(
            f"accumulate_grad({name!r}): gradients must be floating point, got {grad.dtype}"
        )


def check_name(name: str, shapes: Mapping[str, torch.Size]) -> None:
    """`name` is one of the buffer's tensors."""
    if name not in shapes:
        shown = ", ".join(list(shapes)[:8])
        raise KeyError(f"no tensor named {name!r} in this DBuffer; valid: {shown}")


def renamed_keyword(old: str, old_value: int | None, new: str, new_value: int | None) -> int | None:
    """`new_value`, or the value given under the deprecated keyword `old` (with a warning)."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ValueError(f"DBuffer: pass {new} only ({old} is its deprecated name), not both")
    warnings.warn(
        f"DBuffer({old}=...) is deprecated: use {new} (a mesh axis)", DeprecationWarning, 3
    )
    return old_value


class DeprecatedAxisNames:
    """`DBuffer`'s former names of its mesh axes (`shard_dim`, `replicate_dim`), warning."""

    shard_axis: int
    replicate_axis: int | None

    @property
    def shard_dim(self) -> int:
        """Deprecated name of `shard_axis`."""
        warnings.warn("DBuffer.shard_dim is deprecated: use shard_axis", DeprecationWarning, 2)
        return self.shard_axis

    @property
    def replicate_dim(self) -> int | None:
        """Deprecated name of `replicate_axis`."""
        warnings.warn(
            "DBuffer.replicate_dim is deprecated: use replicate_axis", DeprecationWarning, 2
        )
        return self.replicate_axis
