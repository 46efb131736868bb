"""HostShard: a DBuffer whose shard and gradient shard live in host memory (CPU offload).

The buffer then has two devices. Its shard (`local`, what the optimizer steps) and its reduced
gradient shard (`local_grad`) are host tensors, pinned when the compute device is an
accelerator and `pin_memory` asks for it; the gathered parameters and the full gradients stay
on the compute device (the mesh's). So a step moves each rank's shard across once each way:
- `unshard` copies the host shard into this rank's chunk of the device-side global buffer (the
  copy the mixed-precision cast already makes: in one op, cast included) and gathers in place;
- `reduce_scatter` reduces into a device-side temporary, and that shard is copied into
  `local_grad` (after the HSDP all-reduce, which runs on the device too); from pinned memory
  the copy is asynchronous and the first read of `local_grad` waits for it.

On a CPU mesh host and device are the same memory; the copies are made all the same (the
gathered buffer never aliases the shard), so a CPU run takes the offloaded path step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer._streams import Event, record_event


@dataclass(frozen=True)
class HostShard:
    """Keep a DBuffer's shard and its gradient shard in host memory (see the module docstring).

    Attributes:
        pin_memory: Page-lock the host tensors when the compute device is an accelerator, so
            that copies to and from it are asynchronous (no effect on a CPU mesh, which has
            nothing to pin for).

    Example:
        >>> HostShard().pin_memory
        True
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"HostShard.pin_memory must be a bool, got {self.pin_memory!r}")

    def pins(self, compute_device: torch.device) -> bool:
        """Whether host tensors for `compute_device` are pinned."""
        return self.pin_memory and compute_device.type not in ("cpu", "meta")

    def empty(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        """An uninitialized host tensor of `numel` elements (on meta while the buffer is)."""
        if compute_device.type == "meta":
            return torch.empty(numel, dtype=dtype, device="meta")
        return torch.empty(numel, dtype=dtype, pin_memory=self.pins(compute_device))

    def place(self, tensor: torch.Tensor, compute_device: torch.device) -> torch.Tensor:
        """`tensor` in host memory, pinned as asked: itself if it is already, else a copy."""
        if tensor.device.type == "meta" and compute_device.type == "meta":
            return tensor
        if tensor.device.type == "cpu" and tensor.is_pinned() == self.pins(compute_device):
            return tensor
        host = self.empty(tensor.numel(), tensor.dtype, compute_device)
        return host.copy_(tensor.reshape(-1)).view(tensor.shape)


def check_host_shard(host_shard: object, gather_format: object) -> HostShard | None:
    """`DBuffer`'s `host_shard` argument, checked against its `gather_format`."""
    if host_shard is None:
        return None
    if not isinstance(host_shard, HostShard):
        raise TypeError(f"host_shard must be a HostShard or None, got {host_shard!r}")
    if gather_format is not None:
        raise ValueError(
            f"gather_format={gather_format!r} quantizes the shard on the device, and "
            f"host_shard keeps it in host memory; pass one of them"
        )
    return host_shard


def compute_device(tensor_device: torch.device, mesh: DeviceMesh) -> torch.device:
    """Where an offloaded buffer gathers and reduces: the mesh's device (meta stays meta).

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> compute_device(torch.device("cpu"), init_device_mesh("cpu", (1,)))
        device(type='cpu')
    """
    if tensor_device.type == "meta":
        return tensor_device
    if tensor_device.type == mesh.device_type:
        return tensor_device
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


class HostLanding:
    """A reduced gradient shard on the compute device, on its way into host memory.

    Args:
        shard: The reduced shard (the buffer's dtype), on the compute device.
        accumulate: Add it to the host shard instead of overwriting it.
    """

    def __init__(self, shard: torch.Tensor, *, accumulate: bool) -> None:
        self.shard, self.accumulate = shard, accumulate
        self._started: tuple[torch.Tensor | None, Event | None] | None = None

    @property
    def started(self) -> bool:
        """Whether the copy into host memory was issued."""
        return self._started is not None

    def start(self, host: torch.Tensor) -> None:
        """Issues the copy into `host` (or into a host temporary to add); asynchronous if pinned."""
        if self._started is not None:
            return
        pinned = host.is_pinned()
        target = torch.empty_like(host, pin_memory=pinned) if self.accumulate else host
        target.copy_(self.shard, non_blocking=pinned)
        event = record_event(self.shard.device) if pinned else None
        self._started = (target if self.accumulate else None, event)

    def land(self, host: torch.Tensor) -> None:
        """Waits for the copy (starting it if needed) and adds it in when accumulating."""
        self.start(host)
        assert self._started is not None
        added, event = self._started
        if event is not None:
            event.synchronize()
        if added is not None:
            host.add_(added)
