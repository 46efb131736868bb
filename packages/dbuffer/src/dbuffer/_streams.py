"""Stream bookkeeping for freeing and reusing buffer memory on CUDA, without `record_stream`.

The caching allocator ties a block to the stream that allocated it and hands it out again to
the next allocation on that stream as soon as it is freed on the host. That is safe only if
every other stream that used the block is done with it, so before freeing, the allocating
stream waits for the stream that frees (which has itself waited for the collective that used
the memory): later work on the allocating stream, including the block's next owner, is then
ordered after every use. This is the explicit-wait pattern; `record_stream` instead delays the
free until the allocator polls an event, which holds memory longer and fragments the pools.

On devices without streams (CPU) every helper is a no-op.
"""

from __future__ import annotations

import torch

__all__ = ["Event", "Stream", "current_stream", "free_storage", "record_event", "wait_event"]

Stream = torch.cuda.Stream
Event = torch.cuda.Event


def current_stream(device: torch.device) -> Stream | None:
    """The current stream of `device`, or None where there are no streams."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def free_storage(tensor: torch.Tensor, alloc_stream: Stream | None) -> None:
    """Frees `tensor`'s storage (resized to 0 bytes; its views stay valid objects).

    Args:
        tensor: The tensor whose whole storage is freed.
        alloc_stream: The stream the storage was allocated on (None on CPU).
    """
    current = current_stream(tensor.device)
    if alloc_stream is not None and current is not None and alloc_stream != current:
        alloc_stream.wait_stream(current)
    tensor.untyped_storage().resize_(0)


def record_event(device: torch.device) -> Event | None:
    """An event recorded on `device`'s current stream, or None without streams."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def wait_event(event: Event | None, device: torch.device) -> None:
    """Makes `device`'s current stream wait for `event` (no-op for None)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
