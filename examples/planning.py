"""The example decoder as shard_planner sees it: its FSDP groups, from shapes alone.

A real model is described by a preset or a group file; the example model by its parameters'
names and shapes, grouped as its `fully_shard` calls wrap it: the embedding, each block, and
the final norm with the head (one call on the two modules). `shard_planner.advise` and
`estimate` take these groups; `fully_shard_calls` prints the calls that make them.
"""

from __future__ import annotations

from model import Decoder

from shard_planner import GroupSpec


def decoder_groups(model: Decoder) -> list[GroupSpec]:
    """The decoder's groups as FSDP wraps it: embedding, each block, norm with head."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    layers = [
        GroupSpec.from_shapes(
            f"layers.{i}", {n: s for n, s in shapes.items() if n.startswith(f"layers.{i}.")}
        )
        for i in range(len(model.layers))
    ]
    return [
        GroupSpec.from_shapes("embed", {"embed.weight": shapes["embed.weight"]}),
        *layers,
        GroupSpec.from_shapes("final", {n: shapes[n] for n in ("norm.weight", "head.weight")}),
    ]
