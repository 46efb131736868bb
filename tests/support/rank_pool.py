"""A pool of gloo ranks kept alive across tests: spawn once, run many checks.

Spawning a process group costs seconds on 2 cores, so each world size gets one pool for the
whole pytest run (the `pools` fixture of the root conftest.py); `RankPool.run(fn, *args)` runs
an importable function on every rank and returns the per-rank results, or raises with the
failing rank's traceback. A rank that does not answer within the timeout fails the test (and
the pool is rebuilt) instead of hanging the run; a rank that dies (a native crash) fails it at
once with the exit status, and faulthandler prints every thread's Python stack on the way out.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

# How long a check may run on every rank (RANK_POOL_TIMEOUT_S shortens it while debugging a
# hang: the ranks' tracebacks come out sooner).
TIMEOUT_S = int(os.environ.get("RANK_POOL_TIMEOUT_S", "180"))
_POLL_S = 1.0  # how often a waiting run() checks that every rank is still alive


def _worker(
    rank: int, world_size: int, backend: str, init_file: str, tasks: Any, results: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    faulthandler.enable(all_threads=True)  # a native crash names the Python lines it hit
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    import ragged_placement  # noqa: F401  (installs the DTensor hooks)

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    os._exit(0)  # interpreter teardown after gloo work can abort spuriously


class RankPool:
    """`world_size` spawned ranks joined in one process group (gloo; nccl: one GPU per rank)."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, backend, init_file, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT_S) -> list[Any]:
        """Runs fn(*args) on every rank; returns the results in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        results: dict[int, Any] = {}
        failures: list[str] = []
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = self._dead_ranks()
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    self.close()
                    if dead:
                        raise RuntimeError(
                            f"{fn.__name__}: rank(s) died: {'; '.join(dead)} (their stderr, "
                            f"above, holds faulthandler's stacks)"
                        ) from None
                    missing = sorted(set(range(self.world_size)) - set(results))
                    # A rank that failed often leaves the others waiting on a collective:
                    # its traceback says why they did not finish.
                    raise TimeoutError(
                        f"ranks {missing} did not finish {fn.__name__} in {timeout} s"
                        + "".join(f"\n{failure}" for failure in failures)
                    ) from None
                continue
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                results[rank] = None
        if failures:
            self.broken = True  # a failed collective can leave the group out of step
            self.close()
            raise AssertionError(
                f"{fn.__name__} failed on {len(failures)} rank(s)\n" + "\n".join(failures)
            )
        return [results[r] for r in range(self.world_size)]

    def _dead_ranks(self) -> list[str]:
        dead = []
        for rank, proc in enumerate(self._procs):
            code = proc.exitcode
            if code is not None:
                how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
                dead.append(f"rank {rank} ({how})")
        return dead

    def close(self) -> None:
        """Stops the ranks."""
        for tasks in self._tasks:
            with contextlib.suppress(ValueError, OSError):
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._dir.cleanup()


class Pools:
    """One lazily started RankPool per world size, rebuilt after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __getitem__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            if not pool.broken:
                pool.close()


def expect_error(error: type[BaseException], fn: Callable[[], object], match: str) -> None:
    """Asserts that fn() raises `error` with `match` in its message (usable inside ranks)."""
    try:
        fn()
    except error as exc:
        assert match in str(exc), f"expected {match!r} in {exc}"
    else:
        raise AssertionError(f"expected {error.__name__} matching {match!r}")
