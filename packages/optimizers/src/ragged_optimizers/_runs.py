"""A param group as runs of adjacent parameter pieces, and each step's segments of them.

On `fully_shard` (a DBuffer per group) a rank's pieces of a group's parameters are adjacent
views of one flat shard, and their gradients adjacent views of another. An elementwise
optimizer can then step each run of adjacent pieces as one tensor: its state is one flat
tensor per key, and what each parameter's `state` exposes is a view of its part. Which
parameters form runs is read once from the parameters (`ragged_placement.flat_runs`, in
storage order); every step the gradients are checked to form the same runs (adjacent views
of one storage, piece for piece the same sizes) with a fixed number of Python calls per run,
not per parameter. Where they do not (a missing gradient, one a user replaced, a parameter
whose step count lags because it had no gradient in an earlier step) the run is cut into
segments that do, down to single parameters, which step on their own pieces with the same
arithmetic.

Plain parameters and FSDP2's Shard(0) DTensors own their storage: each is a run of its own.
Padding between two pieces ends a run, so it is never stepped and never in a state.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import torch
from torch.distributed.tensor import DTensor

from ragged_placement import flat_runs, local_pieces, storage_order, with_local

_GRAD = operator.attrgetter("grad")
_NUMEL = torch.Tensor.numel
_OFFSET = torch.Tensor.storage_offset
_DENSE = torch.Tensor.is_contiguous
_STORAGE = torch.Tensor.untyped_storage
_ADDRESS = torch.UntypedStorage.data_ptr


@dataclass(eq=False)
class Run:
    """Parameters whose local pieces are adjacent in one storage, and their flat state.

    Attributes:
        params: The parameters, in storage order.
        pieces: Their local pieces.
        flat: The pieces as one tensor (see `ragged_placement.FlatRun.flat`).
        sizes: Each piece's number of elements.
        positions: Where each piece starts in `flat`, then the end.
        counts: Each parameter's steps so far (a parameter without a gradient does not step).
        steps: The same as float32 on the CPU; each parameter's `state["step"]` views one.
        state: Flat state tensors by key (shaped like `flat`), allocated at first use.
    """

    params: list[torch.Tensor]
    pieces: list[torch.Tensor]
    flat: torch.Tensor
    sizes: tuple[int, ...]
    positions: list[int]
    counts: list[int]
    steps: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    uniform: bool = True  # every parameter has the same count

    def __post_init__(self) -> None:
        self.filled = [i for i, size in enumerate(self.sizes) if size]
        self.filled_positions = [self.positions[i] for i in self.filled]
        self.size_list = list(self.sizes)

    def matching_grad(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The gradients as one tensor laid out like `flat`, or None if they are not.

        They are when their local pieces have the parameters' sizes, and the non-empty ones
        are contiguous pieces of one storage, of the parameters' dtype, at the parameters'
        relative positions. Checked with a fixed number of Python calls.
        """
        pieces = local_pieces(grads)
        if list(map(_NUMEL, pieces)) != self.size_list:
            return None
        if not self.filled:
            return self.flat  # nothing to read: every piece is empty
        filled = [pieces[i] for i in self.filled]
        offsets = list(map(_OFFSET, filled))
        start = offsets[0] - self.filled_positions[0]  # where position 0 would be
        if [offset - start for offset in offsets] != self.filled_positions:
            return None
        if len(set(map(_ADDRESS, map(_STORAGE, filled)))) != 1 or not all(map(_DENSE, filled)):
            return None
        if {piece.dtype for piece in filled} != {self.flat.dtype}:
            return None
        return filled[0].as_strided((self.positions[-1],), (1,), start)

    def part(self, tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Parameters lo .. hi-1's part of `tensor` (shaped like `flat`).

        In the parameter's own local shape when it is one parameter.
        """
        if len(self.params) == 1:
            return tensor
        piece = tensor[self.positions[lo] : self.positions[hi]]
        return piece.view(self.pieces[lo].shape) if hi - lo == 1 else piece

    def state_tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The flat state `key`, zeros when first asked for."""
        found = self.state.get(key)
        if found is None:
            flat = self.flat  # contiguous zeros of its shape, even where it is not contiguous
            dtype = dtype or flat.dtype
            found = self.state[key] = torch.zeros(flat.shape, dtype=dtype, device=flat.device)
        return found

    def advance(self, lo: int, hi: int) -> None:
        """Counts one more step for parameters lo .. hi-1 (`steps` and `counts`)."""
        count = self.counts[lo] + 1
        if hi - lo == len(self.counts):  # the whole run (uniform before, so after)
            self.counts = [count] * (hi - lo)
            self.steps.fill_(count)
        else:
            self.counts[lo:hi] = [count] * (hi - lo)
            self.steps[lo:hi] = count
            self.uniform = len(set(self.counts)) == 1

    def set_counts(self, indices: Sequence[int], count: int) -> None:
        """Sets the count of the parameters at `indices` (one `uniform` update for all)."""
        for i in indices:
            self.counts[i] = count
            self.steps[i] = count
        self.uniform = len(set(self.counts)) == 1

    def load_counts(self, index: int, step: object, name: str) -> None:
        """Sets parameter `index`'s count from a loaded `state["step"]` (a number or tensor)."""
        if isinstance(step, torch.Tensor):
            step = step.item()
        if not isinstance(step, int | float):
            raise ValueError(f"load_state_dict: the state of {name} has no 'step' ({step!r})")
        self.set_counts([index], int(step))

    def exposed(self, index: int, flat_state: torch.Tensor) -> torch.Tensor:
        """Parameter `index`'s view of a flat state tensor, laid out like the parameter."""
        piece = self.part(flat_state, index, index + 1).view(self.pieces[index].shape)
        param = self.params[index]
        return with_local(param, piece) if isinstance(param, DTensor) else piece.view(param.shape)


class Segment(NamedTuple):
    """Parameters lo .. hi-1 of a run that step together this step, with their operands."""

    run: Run
    lo: int
    hi: int
    param: torch.Tensor
    grad: torch.Tensor


class GroupRuns:
    """A param group's parameters as runs, and the segments each step has.

    Args:
        params: The group's parameters.
        name_of: How to name a parameter in errors.
        cut: Whether a run must end between two adjacent parameters (an optimizer whose
            state has a structure the pieces must share: AdamW8bit's blocks); None: never.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        name_of: Callable[[torch.Tensor], str],
        cut: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    ):
        self.piece_ids = list(map(id, local_pieces(params)))
        self.name_of = name_of
        # In storage order: a user may list parameters in any order.
        self.members = [params[i] for i in storage_order(params)]
        self.runs: list[Run] = []
        self.first_member: list[int] = []  # index into `members` of each run's first
        for found in flat_runs(self.members):
            members = self.members[found.start : found.stop]
            positions = [0]
            for size in found.sizes:
                positions.append(positions[-1] + size)
            bounds = [0]
            if cut is not None:
                bounds += [i for i in range(1, len(members)) if cut(members[i - 1], members[i])]
            bounds.append(len(members))
            for lo, hi in itertools.pairwise(bounds):
                if hi - lo == 1:
                    flat = local_pieces(members[lo:hi])[0]
                else:
                    flat = found.flat[positions[lo] : positions[hi]]
                self.first_member.append(found.start + lo)
                self.runs.append(
                    Run(
                        params=members[lo:hi],
                        pieces=local_pieces(members[lo:hi]),
                        flat=flat,
                        sizes=found.sizes[lo:hi],
                        positions=[p - positions[lo] for p in positions[lo : hi + 1]],
                        counts=[0] * (hi - lo),
                        steps=torch.zeros(hi - lo),
                    )
                )

    def is_current(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether the parameters still have the pieces the runs were made from."""
        return list(map(id, local_pieces(params))) == self.piece_ids

    def segments(self) -> list[Segment]:
        """This step's segments: every parameter with a gradient in exactly one."""
        grads = list(map(_GRAD, self.members))
        missing = [g is None for g in grads]
        out: list[Segment] = []
        for run, first in zip(self.runs, self.first_member, strict=True):
            count = len(run.params)
            got = grads[first : first + count]
            if count == 1:
                if got[0] is not None:
                    out.append(self._single(run, 0, got[0]))
                continue
            if run.uniform and not any(missing[first : first + count]):
                grad = run.matching_grad(cast(list[torch.Tensor], got))
                if grad is not None:
                    out.append(Segment(run, 0, count, run.flat, grad))
                    continue
            out.extend(self._split(run, got))
        return out

    def _split(self, run: Run, grads: list[torch.Tensor | None]) -> list[Segment]:
        """A run's segments when its gradients do not all form one run with it."""
        bounds: list[tuple[int, int]] = []  # stretches with gradients and one step count
        start = -1
        for i, grad in enumerate(grads):
            if start >= 0 and (grad is None or run.counts[i] != run.counts[start]):
                bounds.append((start, i))
                start = -1
            if grad is not None and start < 0:
                start = i
        if start >= 0:
            bounds.append((start, len(grads)))
        out = []
        for lo, hi in bounds:
            got = cast(list[torch.Tensor], grads[lo:hi])
            for found in flat_runs(got):
                a, b = lo + found.start, lo + found.stop
                if b - a > 1 and found.sizes == run.sizes[a:b]:
                    out.append(Segment(run, a, b, run.part(run.flat, a, b), found.flat))
                else:
                    out.extend(self._single(run, i, got[i - lo]) for i in range(a, b))
        return out

    def _single(self, run: Run, index: int, grad: torch.Tensor) -> Segment:
        """One parameter on its own: its piece and its gradient's matching piece."""
        param = run.params[index]
        if isinstance(param, DTensor) != isinstance(grad, DTensor):
            raise TypeError(
                f"{self.name_of(param)} is a {type(param).__name__} but its gradient is a "
                f"{type(grad).__name__}; set .grad to a tensor of the parameter's kind"
            )
        if isinstance(param, DTensor) and isinstance(grad, DTensor):
            if grad.placements != param.placements or grad.device_mesh != param.device_mesh:
                grad = grad.redistribute(param.device_mesh, param.placements)
            grad = local_pieces([grad])[0]  # to_local() would add an autograd node (~10 us)
        if grad.shape != run.pieces[index].shape:
            raise ValueError(
                f"the gradient of {self.name_of(param)} has local shape {tuple(grad.shape)}, "
                f"but the parameter's local piece is {tuple(run.pieces[index].shape)}"
            )
        return Segment(run, index, index + 1, run.pieces[index], grad)
