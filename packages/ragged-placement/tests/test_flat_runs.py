"""flat_runs / storage_order on plain tensors: runs are exactly the maximal adjacent stretches.

DTensor pieces (fully_shard's parameters and gradients) are covered where they are used:
tests/test_optimizers_with_engine.py and fsdp-engine's clip tests.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_placement import flat_runs, local_pieces, storage_order

# One entry: (size, gap before it, kind): kind 0 a view of the shared storage, 1 a tensor
# of its own, 2 a transposed (non-contiguous) view of the shared storage, 3 a float64 tensor.
ENTRY = st.tuples(st.integers(0, 4), st.integers(0, 2), st.sampled_from([0, 0, 0, 1, 2, 3]))


def _tensors(spec: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    storage = torch.arange(float(sum(n + gap for n, gap, _ in spec) * 2 + 4))
    out, at = [], 0
    for size, gap, kind in spec:
        at += gap
        if kind == 0:
            out.append(storage[at : at + size])
        elif kind == 1:
            out.append(torch.full((size,), -1.0))
        elif kind == 2:
            out.append(storage[at : at + 2 * size].view(2, size).t())  # strides (1, size)
            at += size
        else:
            out.append(torch.zeros(size, dtype=torch.float64))
        at += size
    return out


def _joins(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether non-empty b starts where non-empty a ends, in one storage, both dense."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype
        and a.storage_offset() + a.numel() == b.storage_offset()
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(ENTRY, min_size=1, max_size=10))
def test_runs_are_the_maximal_adjacent_stretches(spec) -> None:
    tensors = _tensors(spec)
    runs = flat_runs(tensors)
    assert [r.start for r in runs] == [0] + [r.stop for r in runs[:-1]]  # a partition
    assert runs[-1].stop == len(tensors)
    for run in runs:
        members = tensors[run.start : run.stop]
        filled = [t for t in members if t.numel()]
        assert run.sizes == tuple(t.numel() for t in members)
        assert all(_joins(a, b) for a, b in itertools.pairwise(filled))
        if run.stop - run.start == 1:
            assert run.flat is members[0]
            continue
        assert run.flat.dim() == 1
        expected = torch.cat([t.reshape(-1) for t in filled]) if filled else torch.zeros(0)
        assert torch.equal(run.flat, expected)
        if filled:  # a view: writing through it writes the members
            assert run.flat.data_ptr() == filled[0].data_ptr()
    # Maximal: the last non-empty piece of a run never joins the first of the next.
    for left, right in itertools.pairwise(runs):
        last = [t for t in tensors[left.start : left.stop] if t.numel()]
        first = [t for t in tensors[right.start : right.stop] if t.numel()]
        if last and first:
            assert not _joins(last[-1], first[0])


def test_writes_through_a_run_reach_the_pieces_and_their_version() -> None:
    storage = torch.zeros(6)
    pieces = [storage[0:2], storage[2:2], storage[2:6].view(2, 2)]
    (run,) = flat_runs(pieces)
    version = storage._version
    run.flat.add_(1.0)
    assert torch.equal(storage, torch.ones(6))
    assert storage._version > version  # autograd sees the update, as through each piece


def test_storage_order_sorts_by_storage_then_offset() -> None:
    storage, other = torch.zeros(8), torch.zeros(2)
    tensors = [storage[4:6], other, storage[0:4], storage[6:8]]
    order = storage_order(tensors)
    same = [i for i in order if i != 1]
    assert same == [2, 0, 3]  # one storage's pieces by offset
    assert sorted(order) == [0, 1, 2, 3]
    runs = flat_runs([tensors[i] for i in same])
    assert [(r.start, r.stop) for r in runs] == [(0, 3)]


def test_local_pieces_of_plain_tensors_are_themselves() -> None:
    tensors = [torch.zeros(2), torch.ones(3)]
    assert all(a is b for a, b in zip(local_pieces(tensors), tensors, strict=True))
    assert flat_runs([]) == []
