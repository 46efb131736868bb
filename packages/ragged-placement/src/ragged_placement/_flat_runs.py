"""Runs of tensors whose local pieces lie back to back in one storage, as one flat tensor each.

A DBuffer (and so `fully_shard`) keeps a rank's pieces of a group's parameters, and of their
gradients, as adjacent views of one flat shard. An elementwise pass over many such tensors (an
optimizer step, a gradient norm, a clip) can then run once per run of adjacent pieces instead
of once per tensor. `flat_runs` finds the runs from the tensors alone, plain tensors or
DTensors of any placements, with a fixed number of Python calls for a list of any length (the
per-tensor facts are read by `map` in C; the scan is a loop without calls): it is meant to run
every step on every parameter.

Entries i .. j-1 form a run when every non-empty local piece among them is contiguous, lies
in the same storage, has the same dtype, and starts where the one before it ended. Empty
pieces join any run. Padding between two pieces ends a run: from the tensors alone nothing
says a gap is padding and not a tensor someone else owns. A run's flat tensor is a view of its
first piece (`as_strided` over the run), so an in-place update through it bumps the autograd
version counter that piece shares with its buffer, as an update through the piece would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ragged_placement._compat import locals_of

_OFFSET = torch.Tensor.storage_offset
_NUMEL = torch.Tensor.numel
_DENSE = torch.Tensor.is_contiguous
_STORAGE = torch.Tensor.untyped_storage
_ADDRESS = torch.UntypedStorage.data_ptr


@dataclass(frozen=True)
class FlatRun:
    """Entries `start` .. `stop - 1` of a list of tensors, whose local pieces `flat` covers.

    Attributes:
        start: The first entry's index.
        stop: One past the last entry's index.
        flat: A 1-D view over the entries' pieces, in order, when the run has more than one
            entry; the entry's own local piece (any shape or strides) when it has one.
        sizes: Each entry's number of local elements.
    """

    start: int
    stop: int
    flat: torch.Tensor
    sizes: tuple[int, ...]


def storage_order(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of `tensors` sorted by where their local pieces lie: by storage, then offset.

    Example:
        >>> base = torch.arange(4.0)
        >>> storage_order([base[2:], base[:2]])
        [1, 0]
    """
    pieces = locals_of(tensors)
    keys = list(zip(map(_ADDRESS, map(_STORAGE, pieces)), map(_OFFSET, pieces), strict=True))
    return sorted(range(len(pieces)), key=keys.__getitem__)


def local_pieces(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's local piece: a DTensor's local tensor (no autograd), a plain tensor itself.

    Walked in C for a list of DTensors (or of plain tensors): no Python call per entry.

    Example:
        >>> [t.shape for t in local_pieces([dt, torch.ones(2)])]
        [torch.Size([32]), torch.Size([2])]
    """
    return locals_of(tensors)


def flat_runs(tensors: Sequence[torch.Tensor]) -> list[FlatRun]:
    """Splits `tensors` into maximal runs of consecutive entries whose pieces are adjacent.

    Every entry is in exactly one run; an entry that joins no other is a run of its own.

    Args:
        tensors: Plain tensors or DTensors (their local pieces are what is looked at).

    Returns:
        The runs, in order.

    Example:
        >>> base = torch.arange(6.0)
        >>> runs = flat_runs([base[0:2], base[2:5], base[5:6].view(1, 1), torch.ones(3)])
        >>> [(r.start, r.stop, r.flat.tolist()) for r in runs]
        [(0, 3, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), (3, 4, [1.0, 1.0, 1.0])]
    """
    pieces = locals_of(tensors)
    if not pieces:
        return []
    numels = list(map(_NUMEL, pieces))
    offsets = cast(list[int], list(map(_OFFSET, pieces)))
    dense = list(map(_DENSE, pieces))
    bases = list(map(_ADDRESS, map(_STORAGE, pieces)))  # a storage's address names it
    dtypes = [piece.dtype for piece in pieces]
    bounds: list[tuple[int, int]] = []  # [start, stop) of each run
    start, base, end, dtype, closed = 0, None, 0, None, False  # base: the run's storage
    for i in range(len(pieces)):
        if not numels[i]:
            if closed:  # nothing joins a run whose piece cannot be flattened
                bounds.append((start, i))
                start, base, closed = i, None, False
            continue
        adjacent = base is not None and bases[i] == base and offsets[i] == end
        if adjacent and dense[i] and dtypes[i] == dtype:
            end += numels[i]
            continue
        # Nothing joins a piece that cannot be flattened (nor one with no memory: a meta
        # tensor), and it joins nothing, not even empty pieces before it.
        alone = not dense[i] or not bases[i]
        if base is not None or closed or (alone and i > start):
            bounds.append((start, i))
            start = i
        base, end, dtype, closed = bases[i], offsets[i] + numels[i], dtypes[i], alone
        if closed:
            base = None
    bounds.append((start, len(pieces)))
    return [_made(pieces, lo, hi, numels) for lo, hi in bounds]


def _made(pieces: list[torch.Tensor], start: int, stop: int, numels: list[int]) -> FlatRun:
    """The run [start, stop) with its flat view."""
    sizes = tuple(numels[start:stop])
    if stop - start == 1:
        return FlatRun(start, stop, pieces[start], sizes)
    filled = [i for i in range(start, stop) if numels[i]]
    if len(filled) <= 1:
        only = pieces[filled[0]] if filled else pieces[start]
        return FlatRun(start, stop, only.reshape(-1), sizes)
    first = pieces[filled[0]]
    lo = first.storage_offset()
    hi = pieces[filled[-1]].storage_offset() + numels[filled[-1]]
    return FlatRun(start, stop, first.as_strided((hi - lo,), (1,), lo), sizes)
