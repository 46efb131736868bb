"""Guarded views of a DBuffer's freeable buffers: they refuse to be read while freed.

Used when freed-memory checks are on (`DBUFFER_CHECK_FREED=1`, or `check_freed=True`); by
default the views are plain tensors (`_freeable.py` says what stays checked then).

`reshard()` frees the global buffer by resizing its storage to zero bytes, and
`reduce_scatter()` does the same to the global gradient buffer; the views handed out by
`full()` / `full_grad()` stay the same objects and see the memory again once it is
re-allocated. Reading such a view while the storage is freed would dereference a null pointer
in most kernels (a segfault on CPU, an illegal access on CUDA), so the views are a thin
subclass whose `__torch_function__` checks the storage first and raises a clear error.

Metadata (shape, dtype, strides, properties, hooks) stays readable while freed. Ops run on
plain tensors and return plain tensors, so the check costs one Python call per op that takes a
view directly and nothing downstream; outputs that alias the buffer (`t()`, `view`, slicing,
`detach`, hence `nn.Parameter(view)`, `.data`, `as_subclass(torch.Tensor)`) are wrapped
again, so they are guarded too. `as_subclass` to another subclass is refused: its instances
could not be guarded. A view that autograd saves for backward is unpacked through a check too,
so a backward that runs while the buffer is freed raises the same clear error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from dbuffer._compat import (
    TENSOR_DATA_GET,
    TENSOR_IS_VIEW,
    base_of,
    is_view,
    plain_tensor_ops,
    storage_key,
    version_of,
)

# Tensor methods that read no element: allowed on a freed view.
_METADATA: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.untyped_storage,
        torch.Tensor.data_ptr,
        torch.Tensor.element_size,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.requires_grad_,
        torch.Tensor.register_hook,
        torch.Tensor.register_post_accumulate_grad_hook,
        TENSOR_IS_VIEW,
        torch.Tensor.__len__,
    }
)


class Memory(Protocol):
    """What a view asks before an op: whether its buffer holds its memory now."""

    @property
    def allocated(self) -> bool: ...


class BufferView(torch.Tensor):
    """A view of a DBuffer buffer (see the module docstring); `what` names it in errors."""

    what: str
    memory: Memory

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        with plain_tensor_ops():
            views = [a for a in _tensor_args(args, kwargs) if isinstance(a, BufferView)]
            # Property getters and setters (`.shape`, `.grad`, ...) only touch metadata.
            if func not in _METADATA and getattr(func, "__name__", "") not in (
                "__get__",
                "__set__",
            ):
                for view in views:
                    if view.numel() and not view.memory.allocated:
                        raise RuntimeError(
                            f"{view.what} is freed; {func_name(func)} cannot read it. "
                            f"{_hint(view.what)}"
                        )
            if views and torch.is_grad_enabled() and not torch.compiler.is_compiling():
                # Ops that save a view for backward get its freed check at unpack time.
                # Kernels save their own aliases (linear saves weight.t()): match by storage.
                owners = {storage_key(v): v for v in views}
                pack = functools.partial(_pack, owners)
                with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            return _rewrap(out, views, func)

    def as_subclass(self, cls: type[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        """A guarded alias for `torch.Tensor`; other subclasses would escape the guard."""
        if cls is torch.Tensor or issubclass(cls, BufferView):
            return guard(torch.Tensor.as_subclass(self, torch.Tensor), self.what, self.memory)
        raise TypeError(
            f"as_subclass({cls.__name__}) of {self.what} would escape the guard against "
            "reading freed memory; clone() it, or take .as_subclass(torch.Tensor) (guarded)"
        )


class _Saved:
    """An alias of a buffer that autograd saved for backward, with its version at the time."""

    __slots__ = ("memory", "tensor", "version", "what")

    def __init__(self, tensor: torch.Tensor, owner: BufferView) -> None:
        self.tensor = tensor
        self.what, self.memory = owner.what, owner.memory
        self.version = version_of(tensor)


def _pack(owners: dict[int, BufferView], tensor: torch.Tensor) -> object:
    owner = owners.get(storage_key(tensor))
    return tensor if owner is None else _Saved(tensor, owner)


def _unpack(saved: object) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        assert isinstance(saved, torch.Tensor)
        return saved
    tensor = saved.tensor
    with plain_tensor_ops():
        if tensor.numel() and not saved.memory.allocated:
            raise RuntimeError(
                f"{saved.what} is freed; backward needs it (autograd saved it in forward). "
                f"{_hint(saved.what)}"
            )
        if version_of(tensor) != saved.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: {saved.what} is at version {version_of(tensor)}; expected "
                f"version {saved.version} instead"
            )
    return tensor


def guard(tensor: torch.Tensor, what: str, memory: Memory) -> BufferView:
    """`tensor` (a view of `memory`) as a BufferView described as `what`."""
    view = tensor.as_subclass(BufferView)
    view.what, view.memory = what, memory
    return view


def func_name(func: Callable[..., Any]) -> str:
    """A readable name of a torch function or Tensor method, for error messages."""
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    return name.replace("_TensorBase.", "Tensor.").replace("TensorBase.", "Tensor.")


def _hint(what: str) -> str:
    if what.startswith("full gradient"):
        return "reduce_scatter() released it; call full_grad(name) for a zeroed one."
    return "The DBuffer is resharded: call unshard() and wait() before reading it."


def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, list | tuple):  # foreach ops, cat, stack
            found.extend(a for a in arg if isinstance(a, torch.Tensor))
    return found


def _rewrap(out: Any, views: list[BufferView], func: Callable[..., Any]) -> Any:
    """Re-guards outputs that alias one of `views`; other outputs stay plain.

    Aliases are views whose base is a view's base (or the view itself, for views of an
    `nn.Parameter(view)`), and `detach()` of a view; checking identities keeps this cheap on
    the hot path (a compute op's output is not a view and returns at once).
    """
    if type(out) in (list, tuple):  # split, unbind, chunk
        return type(out)([_rewrap(o, views, func) for o in out])
    if not isinstance(out, torch.Tensor) or isinstance(out, BufferView):
        return out
    if func is _DETACH or func == _DATA:  # aliases that autograd does not mark as views
        return guard(out, views[0].what, views[0].memory) if views else out
    if not is_view(out):
        return out
    base = base_of(out)
    for view in views:
        if base is view or base is base_of(view):
            return guard(out, view.what, view.memory)
    return out


_DETACH = torch.Tensor.detach
_DATA = TENSOR_DATA_GET


def buffer_views(
    buffer: torch.Tensor,
    offsets: dict[str, int],
    shapes: dict[str, torch.Size],
    what: str,
    memory: Memory | None,
) -> dict[str, torch.Tensor]:
    """Views of `buffer`: tensor `name` of shape `shapes[name]` at `offsets[name]`.

    Args:
        buffer: A flat buffer holding every tensor at its planned offset.
        offsets: Global start of each tensor.
        shapes: Shape of each tensor.
        what: How errors name the views ("unsharded tensor", "full gradient").
        memory: The owner the views ask whether the buffer is allocated; None for plain
            (unguarded) views.

    Returns:
        The views by name; guarded ones are BufferViews described as f"{what} {name!r}".
    """
    views: dict[str, torch.Tensor] = {}
    for name, off in offsets.items():
        numel = shapes[name].numel()
        view = buffer[off : off + numel].view(shapes[name])
        views[name] = view if memory is None else guard(view, f"{what} {name!r}", memory)
    return views
