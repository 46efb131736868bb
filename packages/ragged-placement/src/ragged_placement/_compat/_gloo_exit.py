"""At interpreter exit, a moment for gloo's worker threads to drop the collectives they ran.

Registered by `install` (`_patches.py`); a workaround, not a patch: it changes nothing in torch.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from ragged_placement._compat import torch_version


def let_gloo_release_work() -> None:
    """At exit, gives gloo's worker threads a moment to drop the collectives they finished.

    A gloo worker thread releases a finished collective's work object some time after
    `wait()` has returned, and with it maybe the last reference to a tensor that Python made
    (the pieces RaggedShard broadcasts into, a reduce-dtype temporary); freeing that tensor
    takes the GIL. If the interpreter is already shutting down by then, the thread dies while
    it unwinds: "terminate called without an active exception", SIGABRT, at the end of a
    program that did all its work (seen here in a third to a half of 3-rank runs on 2 cores).
    Exit handlers run while threads may still take the GIL; sleeping releases it.
    """
    if gloo_threads_alive():
        time.sleep(0.1)


# torch 2.10's gloo leaves its worker threads unnamed (they inherit "python"), so nothing
# tells them from other threads there: the exit handler then always waits (0.1 s). The one
# version compare in this module, since only a running gloo group could show the feature.
GLOO_NAMES_ITS_THREADS = torch_version() >= (2, 11)


def gloo_threads_alive() -> bool:
    if dist.is_available() and dist.is_initialized():
        return True  # a live process group may own worker threads
    if not GLOO_NAMES_ITS_THREADS:
        return dist.is_available()
    try:
        names = [task.joinpath("comm").read_text() for task in Path("/proc/self/task").iterdir()]
    except OSError:  # not Linux: assume they may be
        return dist.is_available()
    return any(name.startswith("pt_gloo_runloop") for name in names)
