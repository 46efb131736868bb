"""CPU offload: FSDP2's `CPUOffloadPolicy` on a group, and which groups to offload.

An offloaded group keeps its sharded parameters and their gradients in host memory (the
DBuffers' `HostShard`), so the optimizer steps them there; each unshard copies the host shard
into the device-side gather buffer once, and each reduce-scatter's shard lands in the host
gradient once. The choice is per `fully_shard` call, as in FSDP2; `offload_within_budget`
picks the calls for a byte budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

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
