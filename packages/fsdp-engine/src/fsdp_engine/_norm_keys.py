"""Gradients grouped by where their norm is reduced: a key per (mesh, sharded axes).

`clip_grad_norm_` asks every gradient, every step, on which mesh it lives and which of its axes
shard it (a local norm is reduced over those). The public `device_mesh` / `placements` are
Python properties; here the spec is read once per spec object (a DBuffer hands out the same
spec objects every step) and keys are interned, so a list of DTensors seen before costs no
Python call per tensor.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from fsdp_engine._compat import dtensor_spec

NormKey = tuple[object, tuple[int, ...]]  # (mesh or device, the mesh axes that shard)

_MESH = operator.attrgetter("mesh")
_PLACEMENTS = operator.attrgetter("placements")
_HELD, _KEY = operator.itemgetter(0), operator.itemgetter(1)
# A gradient's spec is its buffer's, the same object every step: its key is remembered by the
# spec's identity (the spec is held, so its id is not reused), and keys are interned (one
# object per mesh and placement kinds, what is held keeps its id). Bounded: both are dropped
# together when many specs were seen (models built and dropped).
_KEY_OF_SPEC: dict[int, tuple[object, NormKey]] = {}
_INTERNED: dict[tuple[object, tuple[type, ...]], NormKey] = {}
_MAX_SPECS = 1 << 16


def norm_keys(tensors: Sequence[torch.Tensor]) -> list[NormKey]:
    """Per tensor: (its mesh, the mesh axes that shard it) for a DTensor, (device, ()) else.

    Equal keys are the same object (for one mesh object and one set of placement kinds), so
    keys compare and group by identity; DTensors seen before cost no Python call each.

    Example:
        >>> norm_keys([torch.zeros(2)])
        [(device(type='cpu'), ())]
    """
    if not tensors or set(map(type, tensors)) != {DTensor}:
        # A device is a new object per tensor: keyed by value (a mesh by identity).
        specs = [dtensor_spec(t) if isinstance(t, DTensor) else None for t in tensors]
        wheres = [t.device if s is None else s.mesh for t, s in zip(tensors, specs, strict=True)]
        pairs = [
            (where, ()) if spec is None else (id(where), tuple(map(type, spec.placements)))
            for where, spec in zip(wheres, specs, strict=True)
        ]
        return _interned(pairs, wheres)
    specs = list(map(dtensor_spec, tensors))
    known = list(map(_KEY_OF_SPEC.get, map(id, specs)))
    if None not in known and all(map(operator.is_, map(_HELD, known), specs)):  # type: ignore[arg-type]
        return list(map(_KEY, known))  # type: ignore[arg-type]
    if len(_KEY_OF_SPEC) > _MAX_SPECS:
        _KEY_OF_SPEC.clear()
        _INTERNED.clear()
    meshes = list(map(_MESH, specs))
    placements = list(map(_PLACEMENTS, specs))
    ndims = set(map(len, placements))
    if len(ndims) == 1:  # the placement kinds axis by axis, in C
        axes = range(ndims.pop())
        columns = (map(type, map(operator.itemgetter(a), placements)) for a in axes)
        kinds = list(zip(*columns, strict=True))
    else:
        kinds = list(map(tuple, map(map, itertools.repeat(type), placements)))
    keys = _interned(list(zip(map(id, meshes), kinds, strict=True)), meshes)
    _KEY_OF_SPEC.update(zip(map(id, specs), zip(specs, keys, strict=True), strict=True))
    return keys


def _interned(
    pairs: Sequence[tuple[object, tuple[type, ...]]], wheres: Sequence[Any]
) -> list[NormKey]:
    """The interned key of each (mesh id or device, placement kinds) pair."""
    for pair, where in dict(zip(pairs, wheres, strict=True)).items():
        if pair not in _INTERNED:
            kinds = pair[1]
            axes = tuple(i for i, kind in enumerate(kinds) if not issubclass(kind, Replicate))
            key = _INTERNED[pair] = (where, axes)
            if any(issubclass(kind, Partial) for kind in kinds):
                _PARTIAL_KEYS[id(key)] = key
    return list(map(_INTERNED.__getitem__, pairs))


_PARTIAL_KEYS: dict[int, NormKey] = {}  # keys of DTensors with a Partial axis (pending sums)


def is_partial_key(key: NormKey) -> bool:
    """Whether a `norm_keys` key is that of a DTensor with a Partial placement.

    Example:
        >>> is_partial_key(norm_keys([torch.zeros(2)])[0])
        False
    """
    return _PARTIAL_KEYS.get(id(key)) is key
