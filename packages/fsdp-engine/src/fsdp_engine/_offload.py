"""CPU offload: FSDP2's `CPUOffloadPolicy` on a group, and which groups to offload.

An offloaded group keeps its sharded parameters and their gradients in host memory (the
DBuffers' `HostShard`), so the optimizer steps them there; each unshard copies the host shard
into the device-side gather buffer once, and each reduce-scatter's shard lands in the host
gradient once. The choice is per `fully_shard` call, as in FSDP2; `offload_within_budget`
picks the calls for a byte budget. `OptimizerStateOffload` instead keeps only the optimizer
state in host memory between steps, for a step that runs on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from dbuffer import BlockFloat8, HostShard


def host_shard_for(
    offload_policy: object,
    label: str,
    formats: Mapping[str, BlockFloat8],
    subclass: Iterable[str],
) -> HostShard | None:
    """The DBuffers' host shard for `fully_shard`'s `offload_policy` (None: no offload).

    Raises:
        TypeError: `offload_policy` is not an OffloadPolicy.
        ValueError: It offloads a group with parameters it cannot keep in host memory
            (a gather format quantizes on the device; a tensor subclass gathers itself),
            naming the module and the parameter.
    """
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return None
    for fqn in formats:
        raise ValueError(
            f"fully_shard on {label}: offload_policy={offload_policy!r} keeps the shards in "
            f"host memory, but gather_format gathers {fqn!r} as fp8 quantized on the device; "
            f"offload this group or gather it in fp8, not both"
        )
    for fqn in subclass:
        raise ValueError(
            f"fully_shard on {label}: offload_policy={offload_policy!r} cannot offload "
            f"{fqn!r}, a tensor subclass that shards and gathers itself on the device; "
            f"put it in a group without offload (or in ignored_params)"
        )
    return HostShard(pin_memory=bool(offload_policy.pin_memory))


def offload_within_budget(modules: Iterable[nn.Module], max_bytes: int) -> list[nn.Module]:
    """The modules to shard with `CPUOffloadPolicy` so that at most `max_bytes` move to host.

    Largest first (by the bytes of the parameters each holds that no module listed before it
    holds, as `fully_shard` groups them when called on the list bottom-up); each is taken while
    it still fits. Bytes are the model's, not one rank's: each rank then keeps 1/W of them in
    host memory.

    Args:
        modules: The modules `fully_shard` will be called on (e.g. the transformer blocks).
        max_bytes: The most parameter bytes to offload (an int >= 0).

    Returns:
        The chosen modules, in the order given.

    Raises:
        ValueError: `max_bytes` is not an int >= 0.

    Example:
        >>> blocks = [nn.Linear(64, 64), nn.Linear(8, 8), nn.Linear(32, 32)]
        >>> chosen = offload_within_budget(blocks, max_bytes=20_000)
        >>> [block.in_features for block in chosen]  # 16,640 B, then 288 B (not 4,224 B)
        [64, 8]
    """
    value: object = max_bytes  # callers may pass anything; check before use
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    given = list(modules)
    seen: set[int] = set()
    sizes: list[int] = []
    for module in given:
        if not isinstance(module, nn.Module):
            raise TypeError(f"modules must be nn.Modules, got {type(module).__name__}")
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        sizes.append(sum(p.numel() * p.element_size() for p in params))
    left, chosen = max_bytes, set()
    for index in sorted(range(len(given)), key=lambda i: -sizes[i]):
        if sizes[index] <= left:
            chosen.add(index)
            left -= sizes[index]
    return [module for index, module in enumerate(given) if index in chosen]


class OptimizerStateOffload:
    """Keeps an optimizer's state in host memory between steps; each step runs where it was.

    For a model on the device whose optimizer state does not fit beside activations: after
    each step every state tensor is copied into host memory (pinned as asked, asynchronously
    from pinned memory), and before the next step back to the device it was on, so the step
    itself runs on the device at device speed. The state entries are replaced by new tensors
    each way (an optimizer that keeps its own views of its state, as ragged_optimizers'
    AdamW and Muon do, reads replaced entries again). State dicts taken between steps hold
    the host tensors; a state loaded between steps moves to the device at the next step.
    On a CPU device the moves are copies within host memory.

    Args:
        optimizer: A torch optimizer (its step hooks are used).
        pin_memory: Page-lock the host copies when the state was on an accelerator.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> offload = OptimizerStateOffload(opt)
        >>> model(torch.randn(2, 8)).sum().backward(); opt.step()
        >>> offload.num_offloaded > 0  # the moments sit in host memory until the next step
        True
        >>> offload.remove()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, pin_memory: bool = True) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool, got {pin_memory!r}")
        self._optimizer, self._pin = optimizer, pin_memory
        # Where each offloaded entry came from, by (parameter id, key): it goes back there.
        self._devices: dict[tuple[int, str], torch.device] = {}
        self._hooks = [
            optimizer.register_step_pre_hook(lambda *_: self._to_device()),
            optimizer.register_step_post_hook(lambda *_: self._to_host()),
        ]

    @property
    def num_offloaded(self) -> int:
        """State tensors now in host memory (0 while a step runs)."""
        return len(self._devices)

    def remove(self) -> None:
        """Brings the state back to its devices and removes the hooks."""
        self._to_device()
        for hook in self._hooks:
            hook.remove()

    def _to_host(self) -> None:
        for param, state in self._optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._devices[(id(param), key)] = _local(value).device
                    pin = self._pin and _local(value).device.type not in ("cpu", "meta")
                    state[key] = _moved(value, torch.device("cpu"), pin=pin)
        _synchronize_copies(self._devices.values())

    def _to_device(self) -> None:
        devices, self._devices = self._devices, {}
        for param, state in self._optimizer.state.items():
            for key, value in state.items():
                device = devices.get((id(param), key))
                if device is not None and isinstance(value, torch.Tensor):
                    state[key] = _moved(value, device, pin=False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _moved(tensor: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """A copy of `tensor` on `device` (a DTensor keeps its mesh, placements and shape)."""
    local = _local(tensor).detach()
    if pin:
        moved = torch.empty_like(local, device="cpu", pin_memory=True)
        moved.copy_(local, non_blocking=True)
    else:
        moved = local.to(device, copy=True)
    if not isinstance(tensor, DTensor):
        return moved
    return DTensor.from_local(
        moved, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
    )


def _synchronize_copies(devices: Iterable[torch.device]) -> None:
    """Waits for asynchronous copies into pinned memory (their values are read by the host)."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)
