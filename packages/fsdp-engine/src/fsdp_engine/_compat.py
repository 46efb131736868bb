"""Every touch of a torch internal in fsdp_engine lives here, behind ragged_placement's guard.

- `queue_backward_callback(fn)`: `Variable._execution_engine.queue_callback`, which runs `fn`
  once the current backward pass has finished (the engine's end-of-backward work: reduce the
  groups no hook reached, wait for the reduce-scatters, hand out the sharded gradients).
- `in_backward()`: `torch._C._current_graph_task_id() != -1`, true while the autograd engine
  runs a backward pass on this thread (activation checkpointing recomputes forward there).
- `map_tensors(tree, fn)`: torch's pytree (`torch.utils._pytree`), which knows the containers
  libraries register with it (transformers' `ModelOutput`), as FSDP2 walks module inputs and
  outputs.
- `parameter_slots(module)`: `module._parameters`, the dict `nn.Module` keeps its own
  parameters in; the engine swaps sharded and gathered parameters in it directly
  (`register_parameter` would check and re-run hooks per parameter per step) and takes
  entries out around `nn.Module._apply`.
- `ApplyOverride`: a mixin overriding `nn.Module._apply`, the private method behind `.to()`,
  `.cuda()`, `to_empty()` and `.double()`; it hands the conversion to the class's
  `_fsdp_convert(fn, apply)` (the group's parameters are views of its DBuffers, which convert
  as one tensor each), where `apply()` runs nn.Module's own `_apply` on the rest.
- `profiler_range(name)`: `torch.profiler.record_function(name)` only while a profiler runs
  (`torch._C._autograd._profiler_enabled`): a range costs ~8 us even with no profiler, and
  a step enters a few per group.
Tested on the torch versions `ragged_placement.SUPPORTED_TORCH` names; others are refused at
import.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from ragged_placement import check_torch_version

__all__ = [
    "ApplyOverride",
    "in_backward",
    "map_tensors",
    "parameter_slots",
    "profiler_range",
    "queue_backward_callback",
]


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs `fn` when the backward pass now running finishes (call it from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def in_backward() -> bool:
    """Whether this thread is inside a backward pass (e.g. a checkpointed recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


_SCALARS = (bool, int, float, complex, str, bytes)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`tree` with `fn` applied to every tensor in it, every container keeping its class.

    Containers are what torch's pytree knows (tuples, lists, dicts, namedtuples, OrderedDict,
    and classes libraries register, such as transformers' `ModelOutput`), plus dataclasses and
    dict subclasses it does not know (walked field by field, item by item). Tensors and plain
    tuples, lists and dicts are walked here directly: the hooks call this for every group's
    inputs and outputs, and pytree costs tens of Python calls per walk.
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    cls = type(tree)
    if cls is tuple or cls is list:
        return cls([map_tensors(item, fn) for item in tree])
    if cls is dict:
        return {key: map_tensors(item, fn) for key, item in tree.items()}
    if tree is None or cls in _SCALARS:
        return tree

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {
                f.name: map_tensors(getattr(value, f.name), fn)
                for f in dataclasses.fields(value)
                if f.init
            }
            return dataclasses.replace(value, **changes)
        if isinstance(value, dict):  # a dict subclass pytree does not know
            mapped = copy.copy(value)
            for key, item in value.items():
                mapped[key] = map_tensors(item, fn)
            return mapped
        return value

    return pytree.tree_map(leaf, tree)


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The dict `module` registers its own parameters in (names to parameters), live."""
    slots: dict[str, nn.Parameter | None] = module._parameters
    return slots


class ApplyOverride:
    """Routes `nn.Module._apply` through `self._fsdp_convert(fn, apply)` (see above)."""

    def _fsdp_convert(self, fn: Callable[[torch.Tensor], torch.Tensor], apply: Any) -> Any:
        return apply()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        def apply() -> Any:
            return super(ApplyOverride, self)._apply(fn, recurse)  # type: ignore[misc]

        return self._fsdp_convert(fn, apply)


_NO_RANGE = nullcontext()


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A profiler range named `name` while a profiler runs, else a no-op context."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


check_torch_version("fsdp_engine")
