"""Measuring a training step: peak memory, copy kernels, bytes all-gathered.

The first two come from the torch profiler, the last from CommCounter. All work the same way
for any engine, so that ours and torch FSDP2 are measured alike.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function


@contextlib.contextmanager
def _native_stderr_to_null() -> Iterator[None]:
    """Sends this process's file descriptor 2 to /dev/null while the block runs.

    kineto prints "USDT ... profiler_start / profiler_stop" and the CPU allocator warns about
    blocks allocated before profiling started, from C++ on every profiler start and stop;
    KINETO_LOG_LEVEL does not reach them. Only the profiler's start and stop run inside.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


@contextlib.contextmanager
def quiet_profile(**options: Any) -> Iterator[Any]:
    """`torch.profiler.profile(**options)`, without the lines it prints on start and stop."""
    prof = profile(**options)
    with _native_stderr_to_null():
        prof.start()
    try:
        yield prof
    finally:
        with _native_stderr_to_null():
            prof.stop()


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach now (CPU and CUDA).

    DTensors count their local tensor; freed (resized-to-zero) storages count nothing.
    """
    return sum(live_storages().values())


def live_storages() -> dict[int, int]:
    """The distinct storages of every tensor Python can reach now: data pointer -> bytes."""
    import gc

    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance asks a weakref proxy (torch.compile keeps
        # some) for its __class__, which raises ReferenceError once its referent is gone.
        if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        tensor = obj.to_local() if isinstance(obj, DTensor) else obj
        try:
            storage = tensor.untyped_storage()
            # Fake and functional tensors (torch.compile keeps some alive) own no memory:
            # asking for their data pointer raises.
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses, fake tensors
            continue
    return storages


def peak_live_bytes(
    fn: Callable[[], object],
    *,
    include_live: bool = False,
    lead_in: Callable[[], object] | None = None,
) -> int:
    """Peak bytes of tensors allocated (and still live) while `fn` runs, from the profiler.

    The torch profiler records every CPU allocation and free ("[memory]" events); the running
    sum of their sizes, in time order, peaks at the most memory held at once beyond what was
    live when profiling started. It cannot size the free of a block allocated before it
    started (it logs "Memory block of unknown size was allocated before the profiling
    started" and drops the event), so an engine that frees, during `fn`, what it allocated in
    the previous step would be charged for it. `lead_in` runs first under the same profiler,
    outside the measured window: whatever it allocates and `fn` frees is then counted, and the
    live bytes are taken when the window opens.

    Args:
        fn: The work to measure.
        include_live: Add the bytes live when `fn` starts (`live_tensor_bytes()`), so that
            the result is the absolute peak.
        lead_in: Work to run (profiled, not measured) just before `fn`, e.g. the previous
            step, so that `fn`'s frees of its allocations are seen.

    Returns:
        The peak, in bytes.
    """
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if lead_in is not None:
            lead_in()
        start = live_tensor_bytes() if include_live else 0
        with record_function("peak_live_bytes::window"):
            fn()
    assert prof.profiler is not None
    events = list(prof.profiler.kineto_results.events())
    (window,) = [e for e in events if e.name() == "peak_live_bytes::window"]
    begin, end = window.start_ns(), window.start_ns() + window.duration_ns()
    # Each allocation and free is a "[memory]" event with its size (negative for frees).
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0  # beyond what was live when the window opened
    for event in memory:
        if begin <= event.start_ns() <= end:
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
    "fsdp::chunk_cat_mixed_dtype",
    "fsdp::all_gather_copy_in",
)


# Collective internals: gloo clones a reduce-scatter's input inside the c10d op and copies an
# all-gather's result out of its staging buffer when the work is waited on (DBuffer labels
# that wait). Both engines pay these on gloo, NCCL does not; they are not the engine's copies.
_BACKEND = ("c10d::", "DBuffer::wait")


_DTYPE_BYTES = {
    "double": 8,
    "float": 4,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
}


def _bytes_written(event: Any) -> int:
    """Bytes a copy kernel writes, from its recorded shapes and dtypes."""
    numels = [math.prod(shape) if shape else 0 for shape in event.input_shapes]
    dtypes = list(getattr(event, "input_dtypes", [])) + [""] * len(numels)
    if event.name == "fsdp::all_gather_copy_in":  # writes this rank's slice of the output
        itemsize = next((_DTYPE_BYTES[d] for d in dtypes if d in _DTYPE_BYTES), 4)
        return int(event.concrete_inputs[3]) * itemsize
    if not numels or not any(numels):
        return 0
    # copy_(dst, src) and split_with_sizes_copy (all of it) write their largest operand;
    # chunk_cat writes its `out`, the largest.
    largest = max(range(len(numels)), key=numels.__getitem__)
    return numels[largest] * _DTYPE_BYTES.get(dtypes[largest], 4)


@dataclass
class Copies:
    """Copy kernels of one name: how many ran and the bytes they wrote."""

    kernels: int = 0
    bytes: int = 0


def _engine_copies(prof: Any, by_range: bool) -> dict[str, Copies]:
    copies: dict[str, Copies] = {}
    for event in prof.events():
        if event.name not in _COPY_OPS:
            continue
        parent, where = event.cpu_parent, None
        while parent is not None:
            if parent.name in _COPY_OPS or parent.name.startswith(_BACKEND):
                break  # counted at the outer copy, or the backend's own work
            if parent.name.startswith("FSDP::"):
                where = parent.name.split("(")[0].strip()  # the stage, not the group's label
                break
            parent = parent.cpu_parent
        if where is not None:
            key = f"{event.name} in {where}" if by_range else event.name
            entry = copies.setdefault(key, Copies())
            entry.kernels += 1
            entry.bytes += _bytes_written(event)
    return copies


def engine_copies(fn: Callable[[], object], *, by_range: bool = False) -> dict[str, Copies]:
    """Copy kernels `fn` runs inside an FSDP engine's own profiler ranges ("FSDP::*").

    Both our engine and torch FSDP2 label their work "FSDP::*". Counted on the training
    thread, outside the collectives (`_BACKEND`); gloo's other internal copies run on its
    own threads and are not counted for either engine. Bytes use each kernel's own dtype.

    Args:
        fn: Runs the step(s) to measure.
        by_range: Key by "op in FSDP::stage" (the engine's innermost range, e.g.
            "aten::copy_ in FSDP::post_backward"): where in the step each copy runs.

    Returns:
        By op name (or op and stage), the kernels and the bytes they wrote.
    """
    with quiet_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return _engine_copies(prof, by_range)


# What the training thread does in a step, by the outermost profiler event it is inside.
_COMM = (
    "c10d::",
    "comm::wait",
    "DBuffer::wait",
    "DBuffer::all_gather",
    "DBuffer::reduce_scatter",
    "DBuffer::all_reduce",
    "_c10d_functional::",
    "record_param_comms",
    "FSDP::post_backward_rs_wait",
)
_ALLOC = (
    "aten::empty",
    "aten::empty_strided",
    "aten::resize_",
    "aten::new_empty",
    "aten::zeros",
    "aten::new_zeros",
)


@dataclass
class StepBreakdown:
    """Where one step's wall time went on the training thread, in seconds.

    Attributes:
        total: The step, under the profiler (slower than unprofiled).
        comm: Blocked in or launching collectives (exposed communication).
        copies: Engine copy kernels (inside "FSDP::*" ranges, outside collectives).
        alloc: Engine allocations (empty / resize_ inside "FSDP::*" ranges).
        compute: The rest: forward, backward and optimizer math, and framework overhead.
    """

    total: float
    comm: float
    copies: float
    alloc: float

    @property
    def compute(self) -> float:
        """The remainder: what is neither communication nor the engine's copies or allocs."""
        return self.total - self.comm - self.copies - self.alloc


def step_breakdown(fn: Callable[[], object]) -> StepBreakdown:
    """Profiles one call of `fn` and splits its wall time (see `StepBreakdown`).

    Each interval counts once, in the outermost matching event: communication (launching a
    collective, or waiting for one: `Work.wait` is labelled while `fn` runs, for both engines
    alike), then copies and allocations made by the engine (inside its "FSDP::*" ranges);
    compute is the remainder. Only the training thread's events count (gloo works on its own
    threads).
    """
    import torch.distributed as dist
    from torch.autograd.profiler import record_function

    # Waiting on a collective is a plain Python call for either engine: label it.
    original_wait = dist.Work.wait

    def labelled_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        with record_function("comm::wait"):
            return original_wait(self, *args, **kwargs)

    dist.Work.wait = labelled_wait  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        with quiet_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        total = time.perf_counter() - start
    finally:
        dist.Work.wait = original_wait  # type: ignore[method-assign]
    events = prof.events()
    # The profiler numbers threads itself; the training thread is the one running FSDP::*.
    engine_threads = Counter(e.thread for e in events if e.name.startswith("FSDP::"))
    thread = engine_threads.most_common(1)[0][0] if engine_threads else None
    sums = {"comm": 0.0, "copies": 0.0, "alloc": 0.0}
    for event in events:
        if event.thread != thread:
            continue
        kind = _kind(event)
        if kind is None or _counted_above(event):
            continue
        if kind != "comm" and not _inside_engine(event):
            continue
        sums[kind] += event.time_range.elapsed_us() / 1e6
    return StepBreakdown(total, sums["comm"], sums["copies"], sums["alloc"])


def _kind(event: Any) -> str | None:
    name = event.name
    if name.startswith(_COMM):
        return "comm"
    if name in _COPY_OPS:
        return "copies"
    if name in _ALLOC:
        return "alloc"
    return None


def _counted_above(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _kind(parent) is not None:
            return True
        parent = parent.cpu_parent
    return False


def _inside_engine(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("FSDP::"):
            return True
        parent = parent.cpu_parent
    return False


def gathered_bytes(fn: Callable[[], object]) -> int:
    """Bytes this rank receives in the all-gathers of `fn`, as CommCounter records them.

    gloo's in-place gathers are broadcasts: counted too.
    """
    from ragged_placement import CommCounter

    with CommCounter() as counter:
        fn()
    return sum(
        c.bytes_received for c in counter.collectives if c.kind in ("all_gather", "broadcast")
    )
