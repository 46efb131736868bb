"""Handle: a pending DBuffer collective, waited on by the stream that reads its result."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dbuffer._compat import profiler_range
from dbuffer._streams import Event, wait_event


class Handle:
    """A pending collective of a DBuffer; `wait()` orders the caller after it (idempotent).

    On CUDA `wait()` does not block the host: it makes the current stream wait for the
    collective (and for the stream that issued it), so it must be called on the stream that
    reads the result. On CPU it blocks until the data is there.

    Args:
        works: The c10d works of the collective (empty when it ran synchronously).
        device: The device of the buffers involved.
        event: Recorded on the issuing stream after the collective, or None.
        then: Runs once after the wait (e.g. copies a reduce-dtype result back and frees the
            temporaries the collective read).

    Example:
        >>> handle = buf.unshard(async_op=True)
        >>> handle.wait()
    """

    def __init__(
        self,
        works: Sequence[dist.Work | None] = (),
        *,
        device: torch.device | None = None,
        event: Event | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._device = device
        self._event = event
        self._then = then
        self._done = False

    @property
    def done(self) -> bool:
        """Whether `wait()` has run."""
        return self._done

    def wait(self) -> None:
        """Waits for the collective; later calls return at once."""
        if self._done:
            return
        if self._works:
            # Backends may finish a collective (e.g. copy out of a staging buffer) in wait().
            with profiler_range("DBuffer::wait"):
                for work in self._works:
                    work.wait()
        if self._device is not None:
            wait_event(self._event, self._device)
        self._done = True
        self._works, self._event = [], None
        if self._then is not None:
            then, self._then = self._then, None
            then()
