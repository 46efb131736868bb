"""The structure-aware layout planner (the paper's Algorithm 1, in our own reconstruction).

Problem. Tensors t with e_t elements and an unshardable block of g_t elements go into one
global buffer cut into m equal shards of S elements. Choose start offsets l_t and S so that
(1) every shard boundary k*S strictly inside a tensor is one of its block boundaries, (2) each
tensor is one interval and intervals are disjoint (padding only between tensors), (3) S is a
multiple of `align`. Minimise S. This is NP-hard (PARTITION reduces to it), so we search.

Feasibility for a fixed order and S (`_place`). The valid starts of a tensor do not depend on
what lies before it, so placing each tensor at its earliest valid start at or after the end of
the previous one is optimal for that order: an earlier end never removes a choice later. The
earliest valid start is closed-form:
- no boundary strictly inside [c, c + e): start at c;
- S % g == 0: every boundary is aligned once the first one is, so shift c forward by
  (next_boundary - c) % g < g;
- otherwise the tensor may contain at most one boundary (two would be S apart, S is not a
  multiple of g): align the next boundary as above, and if the tensor then reaches past a
  second boundary, try once more in the next shard (later shards are translates of it).

Search for S (`plan_layout`). Feasibility is not monotone in S when block sizes are mixed: a
shard inside tensor t (a "case 3" tensor) needs S % g_t == 0. We walk lcm grids: for the j
largest tensors (the only ones that can hold a shard), S runs over multiples of
lcm(align, g_1..g_j) (`search_grids`). On each grid we probe the smallest multiple at or above
the lower bound, gallop upward until feasible, then bisect down to the smallest feasible
multiple, never past the best S already found. We start from a layout that is always feasible
(S a multiple of every block: each tensor then wastes < g_t) and stop as soon as S meets the
lower bound. This is repeated for each candidate order: model order ("given"), by block size
("block", largest first), by size ("size", largest first), and a dynamic order ("fit");
"auto" keeps the best, preferring the earlier order on ties, and stops at the lower bound
(it tries "fit" only where that can gain enough, see below).

The dynamic order (`_place_fit`). Fixed orders waste most when many equal tensors each longer
than a shard have blocks that do not divide S (MoE experts): such a tensor may hold only one
boundary, so whenever the cursor sits late in a shard it must jump to the next one. "fit"
decides the order while placing: tensors with the same (numel, block) are interchangeable, so
at each step it looks at one tensor of every such type and places the one that wastes nothing
beyond block alignment, preferring types whose block does not divide S (they are the hard
ones; the others fit anywhere and are kept to fill the awkward cursor positions), then the
largest; if every type wastes more, the one that wastes least. Within a type the model order
is kept. On DeepSeek-V3's MoE layers at m = 1024 this reaches the lower bound (0.16% padding)
where the fixed orders need 1.04%. It costs O(n * types) per feasibility check, so "auto"
skips it for groups with more than `MAX_FIT_TYPES` distinct types and when the fixed orders
are already within `FIT_MIN_GAIN` (0.1% of the group) of the lower bound's padding.

Complexity: O(|orders| * |grids| * log(S_max / grid) * n) integer operations for the fixed
orders (times the number of types, <= MAX_FIT_TYPES, for "fit"), with |grids| <= n + 1 and
usually a handful, n the number of tensors. Planning 1,000 tensors at m = 10240 takes well
under 0.3 s in CPython (see benchmarks/bench_planner.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from shard_planner._bounds import ceil_to, lower_bound, search_grids
from shard_planner._layout import Layout
from shard_planner._spec import TensorSpec, check_count, check_world_size

Order = Literal["given", "block", "size", "fit", "auto"]
ORDERS: tuple[Order, ...] = ("given", "block", "size", "fit", "auto")
MAX_FIT_TYPES = 64  # "fit" looks at every type at every step: O(n * types) per check
# In "auto", "fit" runs only when the fixed orders leave more padding than this fraction of
# the group above the lower bound's: it costs several times their planning time.
FIT_MIN_GAIN = 0.001

Placement = tuple[list[int], list[int]]  # (tensor indices in buffer order, their starts)


def _earliest_start(cursor: int, e: int, g: int, size: int) -> int | None:
    """Earliest valid start at or after `cursor` of a tensor of e elements in blocks of g.

    None when no start in this shard or the next one is valid (then none is: later shards
    are translates of these two).
    """
    if g == 1:
        return cursor
    boundary = (cursor // size + 1) * size
    if cursor + e <= boundary:
        return cursor
    start = cursor + (boundary - cursor) % g
    rem = size % g
    if rem:
        if e >= 2 * size:
            return None
        if start + e > boundary + size:
            start = boundary + rem
            if start + e > boundary + 2 * size:
                return None
    return start


def _place(
    sizes: Sequence[int], atoms: Sequence[int], size: int, capacity: int
) -> list[int] | None:
    """Earliest-start placement of tensors in this order with shard size `size`.

    Returns the start offsets, or None when the tensors do not fit in `capacity` elements.
    """
    starts = []
    cursor = 0
    for e, g in zip(sizes, atoms, strict=True):
        start = _earliest_start(cursor, e, g, size)
        if start is None:
            return None
        cursor = start + e
        if cursor > capacity:
            return None
        starts.append(start)
    return starts


def _types(specs: Sequence[TensorSpec]) -> dict[tuple[int, int], list[int]]:
    """Tensor indices by (numel, atom), each list in model order."""
    types: dict[tuple[int, int], list[int]] = {}
    for i, spec in enumerate(specs):
        types.setdefault((spec.numel, spec.atom), []).append(i)
    return types


def _place_fit(
    types: dict[tuple[int, int], list[int]], size: int, capacity: int
) -> Placement | None:
    """The dynamic order "fit" (see the module docstring) with shard size `size`."""
    queues = {key: list(reversed(indices)) for key, indices in types.items()}
    # A type whose block divides S never wastes a whole block, so among those the largest
    # always ranks first: only the "rigid" types need their start computed at each step.
    rigid = [key for key in queues if size % key[1]]
    flexible = sorted((key for key in queues if not size % key[1]), key=lambda k: -k[0])
    order: list[int] = []
    starts: list[int] = []
    cursor = 0
    while rigid or flexible:
        best: tuple[int, int, int, tuple[int, int]] | None = None  # (waste, -e, start, key)
        for key in rigid:
            e, g = key
            start = _earliest_start(cursor, e, g, size)
            if start is None:
                return None
            waste = start - cursor
            candidate = (waste if waste >= g else 0, -e, start, key)
            if best is None or candidate < best:
                best = candidate
        if flexible and (best is None or best[0] > 0):
            key = flexible[0]
            start = _earliest_start(cursor, key[0], key[1], size)
            assert start is not None  # a block that divides S always fits
            best = (0, -key[0], start, key)
        assert best is not None
        key, start = best[3], best[2]
        cursor = start + key[0]
        if cursor > capacity:
            return None
        queue = queues[key]
        order.append(queue.pop())
        starts.append(start)
        if not queue:
            (rigid if size % key[1] else flexible).remove(key)
    return order, starts


class _Search:
    """Finds the smallest feasible S for one tensor order, bounded by the best S so far.

    `order` is a fixed permutation of the tensors, or, for the dynamic order "fit", the
    tensor indices by (numel, atom) (`_types`).
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        order: list[int] | dict[tuple[int, int], list[int]],
        world_size: int,
    ) -> None:
        self.world_size = world_size
        self.order = order
        if isinstance(order, list):
            self.sizes = [specs[i].numel for i in order]
            self.atoms = [specs[i].atom for i in order]
        self.num_checks = 0

    def feasible(self, size: int) -> Placement | None:
        self.num_checks += 1
        capacity = self.world_size * size
        if isinstance(self.order, dict):
            return _place_fit(self.order, size, capacity)
        starts = _place(self.sizes, self.atoms, size, capacity)
        return None if starts is None else (self.order, starts)

    def smallest_on_grid(self, grid: int, low: int, best: int) -> int | None:
        """Smallest feasible multiple of `grid` in [low, best), or None if none is found."""
        k = -(-low // grid)
        if k * grid >= best:
            return None
        if self.feasible(k * grid) is not None:
            return k * grid
        # Gallop up from the last infeasible multiple, then bisect (lo infeasible, hi feasible).
        lo, step = k, 1
        while True:
            hi = lo + step
            if hi * grid >= best:
                hi = (best - 1) // grid
                if hi <= lo or self.feasible(hi * grid) is None:
                    return None
                break
            if self.feasible(hi * grid) is not None:
                break
            lo, step = hi, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.feasible(mid * grid) is not None:
                hi = mid
            else:
                lo = mid
        return hi * grid


def _order(specs: Sequence[TensorSpec], order: Order) -> list[int]:
    indices = list(range(len(specs)))
    if order == "block":
        indices.sort(key=lambda i: -specs[i].atom)
    elif order == "size":
        indices.sort(key=lambda i: -specs[i].numel)
    return indices


def plan_layout(
    specs: Sequence[TensorSpec],
    world_size: int,
    *,
    align: int = 1,
    order: Order = "auto",
) -> Layout:
    """Plans one group: an offset per tensor and one shard size S for `world_size` ranks.

    Args:
        specs: The group's tensors (unique names, any sizes and blocks).
        world_size: Number of ranks m sharing the buffer, >= 1.
        align: S is a multiple of this many elements, >= 1 (e.g. 16 bytes / itemsize so every
            rank's chunk is aligned for NCCL).
        order: Tensor order in the buffer: "given" (model order), "block" (largest block
            first), "size" (largest first), "fit" (chosen while placing, see the module
            docstring), or "auto" (the best of them, the earlier one on ties; "fit" is tried
            only when the others leave more than 0.1% of the group above the lower bound).

    Returns:
        A validated Layout whose S meets all three constraints (docs/architecture.md, "The
        layout problem").

    Raises:
        TypeError: `specs` holds something other than TensorSpec, or a count is not an int.
        ValueError: a count is out of range, names repeat, or `order` is unknown.

    Example:
        >>> specs = [TensorSpec.from_shape("wq", (64, 32), block_rows=4),
        ...          TensorSpec.from_shape("norm", (32,))]
        >>> layout = plan_layout(specs, world_size=3)
        >>> layout.shard_size, layout.local_units("wq")
        (768, (6, 6, 4))
    """
    world_size = check_world_size("world_size", world_size)
    align = check_count("align", align, 1)
    specs = tuple(specs)
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"specs must hold TensorSpec values, got {type(spec).__name__}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")

    bound = lower_bound(specs, world_size, align=align)
    if bound == 0:  # no elements at all: an empty buffer
        return Layout(world_size, 0, specs, (0,) * len(specs), align)
    total = sum(s.numel for s in specs)
    all_grid = math.lcm(align, *(s.atom for s in specs))
    # Always feasible: with S a multiple of every block, each tensor wastes < its block.
    safe = ceil_to(max(bound, -(-(total + sum(s.atom for s in specs)) // world_size)), all_grid)
    grids = search_grids(specs, align)

    best_size: int = safe
    best_search: _Search | None = None
    searched: set[tuple[int, ...]] = set()
    for name in ("given", "block", "size", "fit") if order == "auto" else (order,):
        if name == "fit":
            types = _types(specs)
            above_floor = (best_size - bound) * world_size
            if order == "auto" and (
                len(types) > MAX_FIT_TYPES or above_floor <= FIT_MIN_GAIN * total
            ):
                continue
            search = _Search(specs, types, world_size)
        else:
            perm = _order(specs, name)
            if tuple(perm) in searched:
                continue
            searched.add(tuple(perm))
            search = _Search(specs, perm, world_size)
        # The first order may return `safe` itself; later ones must beat the best so far, so
        # ties keep the earlier order (the model order first).
        limit = best_size + 1 if best_search is None else best_size
        for grid in grids:
            found = search.smallest_on_grid(grid, bound, limit)
            if found is not None:
                best_size, best_search, limit = found, search, found
                if found == bound:
                    break
        if best_size == bound:
            break

    # The last grid is lcm(align, every block), on which `safe` is feasible in any order
    # (each tensor then wastes less than its block), so the first order searched finds an S.
    assert best_search is not None
    placed = best_search.feasible(best_size)
    assert placed is not None, "the chosen shard size must be feasible for its order"
    starts = [0] * len(specs)
    for i, start in zip(*placed, strict=True):
        starts[i] = start
    return Layout(world_size, best_size, specs, tuple(starts), align)  # validated on creation
