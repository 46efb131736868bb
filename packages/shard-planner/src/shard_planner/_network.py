"""How long a collective takes: rings over the ranks a group spans, node- and rail-aware.

Every collective is a ring: `latency_us` per collective plus `hop_latency_us` per ring step,
plus its wire bytes over a per-rank bandwidth, the intra-node one only when every group of the
collective lies inside one node (nodes hold `ranks_per_node` consecutive ranks). A ring that
crosses nodes runs its node-to-node hops over as many NICs (rails) as it has ranks on a node,
up to `rails`.

A group's ranks are a `Span`: `width` ranks `stride` apart, inside each block of `width x
stride` consecutive ranks of a shard group (plain FSDP: (W, 1); experts under EP e: (W/e, e),
the ranks holding the same experts; a sub-mesh of d ranks: (d, 1)). The ranks holding the
same piece of it are its replicas, `stride x width` apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Span(NamedTuple):
    """The ranks one group is sharded over (module docstring)."""

    width: int
    stride: int = 1

    @property
    def block(self) -> int:
        """Consecutive ranks in which each of the group's pieces is held once."""
        return self.width * self.stride


def crosses_nodes(
    size: int, stride: int, starts: Sequence[int] | range, ranks_per_node: int
) -> bool:
    """Whether any group of `size` ranks `stride` apart, from one of `starts`, spans nodes.

    Example:
        >>> crosses_nodes(6, 1, [0, 6], ranks_per_node=8)  # ranks 6-11 straddle two nodes
        True
    """
    if size == 1:
        return False
    span = (size - 1) * stride
    return any(s // ranks_per_node != (s + span) // ranks_per_node for s in starts)


@dataclass(frozen=True)
class Net:
    """The link figures: (intra, inter-node) bytes per second, latencies, node size, rails."""

    bandwidths: tuple[float, float]
    latency_us: float
    hop_latency_us: float
    ranks_per_node: int
    rails: int = 1

    def ring(self, size: int, stride: int, starts: Sequence[int] | range) -> tuple[float, float]:
        """(fixed seconds, bytes per second) of a ring over `size` ranks (`crosses_nodes`).

        A ring that crosses nodes runs its node-to-node hops over as many rails as the group
        has ranks on a node (NCCL's channels, one per NIC), up to `rails`: `inter x rails`
        per step, never above the intra-node figure.
        """
        fixed = (self.latency_us + (size - 1) * self.hop_latency_us) * 1e-6
        intra, inter = self.bandwidths
        if not crosses_nodes(size, stride, starts, self.ranks_per_node):
            return fixed, intra
        on_a_node = max(1, min(size, self.ranks_per_node // stride))
        return fixed, min(intra, inter * min(self.rails, on_a_node))


def collective_times(
    shard_sizes: Sequence[int],
    spans: Sequence[Span],
    w: int,
    r: int,
    net: Net,
    gathered: int,
    grad_bytes: int,
) -> tuple[list[float], list[float]]:
    """Per group, one all-gather's time and its reduce's (reduce-scatter and all-reduce).

    The all-reduce runs over the group's replicas: HSDP's, and a sub-mesh's copies inside a
    shard group.
    """
    gathers, reduces = [], []
    rings: dict[Span, tuple[float, float, float, float, int]] = {}
    for s, span in zip(shard_sizes, spans, strict=True):
        if span not in rings:
            block = span.block
            starts = [k * w + b * block + j for k in range(r) for b in range(w // block)
                      for j in range(span.stride)]  # fmt: skip
            replicas = r * w // block
            # An all-reduce is a ring of 2 (R - 1) steps.
            all_reduce_fixed = (net.latency_us + 2 * (replicas - 1) * net.hop_latency_us) * 1e-6
            rings[span] = (
                *net.ring(span.width, span.stride, starts),
                all_reduce_fixed,
                net.ring(replicas, block, range(block))[1],
                replicas,
            )
        latency, gbps, replica_latency, replica_gbps, replicas = rings[span]
        gather = reduce = 0.0
        if span.width > 1:
            gather = latency + (span.width - 1) * s * gathered / gbps
            reduce = latency + (span.width - 1) * s * grad_bytes / gbps
        if replicas > 1:
            reduce += (
                replica_latency + 2 * (replicas - 1) / replicas * s * grad_bytes / replica_gbps
            )
        gathers.append(gather)
        reduces.append(reduce)
    return gathers, reduces
