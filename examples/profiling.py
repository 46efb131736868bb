"""Measuring a training step under the torch profiler: peak live memory and copy kernels.

Both work the same way for any engine, so that ours and torch FSDP2 are measured alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach now (CPU and CUDA).

    DTensors count their local tensor; freed (resized-to-zero) storages count nothing.
    """
    import gc

    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        tensor = obj.to_local() if isinstance(obj, DTensor) else obj
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # other wrapper subclasses
            continue
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_live_bytes(fn: Callable[[], object], *, include_live: bool = False) -> int:
    """Peak bytes of tensors allocated (and still live) while `fn` runs, from the profiler.

    The torch profiler records every CPU allocation and free ("[memory]" events); the running
    sum of their sizes, in time order, peaks at the most memory `fn` held at once beyond what
    was live when it started.

    Args:
        fn: The work to measure.
        include_live: Add the bytes live at the start (`live_tensor_bytes()`), so that the
            result is the absolute peak: an engine that keeps buffers across steps (FSDP2
            keeps its last reduce-scatter input) and frees them inside `fn` is not flattered.

    Returns:
        The peak, in bytes.
    """
    start = live_tensor_bytes() if include_live else 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Each allocation and free is a "[memory]" event with its size (negative for frees).
    assert prof.profiler is not None
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return start + peak


_COPY_OPS = (
    "aten::copy_",
    "aten::cat",
    "aten::_chunk_cat",
    "aten::split_with_sizes_copy",
    "aten::clone",
    "aten::_to_copy",
    "fsdp::split_with_sizes_copy",
    "fsdp::chunk_cat",
    "fsdp::all_gather_copy_in",
)


# Collective internals: gloo clones a reduce-scatter's input inside the c10d op and copies an
# all-gather's result out of its staging buffer when the work is waited on (DBuffer labels
# that wait). Both engines pay these on gloo, NCCL does not; they are not the engine's copies.
_BACKEND = ("c10d::", "DBuffer::wait")


def _bytes_written(event: Any, itemsize: int) -> int:
    """Bytes a copy kernel writes, from its recorded shapes (fp32)."""
    if event.name == "fsdp::all_gather_copy_in":  # writes this rank's slice of the output
        return int(event.concrete_inputs[3]) * itemsize
    numels = [math.prod(shape) for shape in event.input_shapes if shape]
    # copy_(dst, src) and split_with_sizes_copy(all of it) write their largest operand;
    # chunk_cat writes its `out`, the largest.
    return max(numels, default=0) * itemsize


@dataclass
class Copies:
    """Copy kernels of one name: how many ran and the bytes they wrote."""

    kernels: int = 0
    bytes: int = 0


def engine_copies(fn: Callable[[], object], itemsize: int = 4) -> dict[str, Copies]:
    """Copy kernels `fn` runs inside an FSDP engine's own profiler ranges ("FSDP::*").

    Both our engine and torch FSDP2 label their work "FSDP::*". Counted on the training
    thread, outside the collectives (`_BACKEND`); gloo's other internal copies run on its
    own threads and are not counted for either engine.

    Args:
        fn: Runs the step(s) to measure.
        itemsize: Bytes per element of the copied tensors.

    Returns:
        By op name, the kernels and the bytes they wrote.
    """
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    copies: dict[str, Copies] = {}
    for event in prof.events():
        if event.name not in _COPY_OPS:
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name in _COPY_OPS or parent.name.startswith(_BACKEND):
                break  # counted at the outer copy, or the backend's own work
            if parent.name.startswith("FSDP::"):
                inside = True
                break
            parent = parent.cpu_parent
        if inside:
            entry = copies.setdefault(event.name, Copies())
            entry.kernels += 1
            entry.bytes += _bytes_written(event, itemsize)
    return copies
