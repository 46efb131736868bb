"""Layout: the planner's answer, a frozen value that every consumer can query and re-check.

Coordinates: the group lives in one global buffer of `world_size * shard_size` elements; rank
k owns `[k * shard_size, (k + 1) * shard_size)`. Tensor t occupies `[offsets[t], offsets[t] +
numel)`. Padding sits only between tensors and after the last one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from shard_planner._bounds import lower_bound
from shard_planner._spec import TensorSpec, check_count, check_world_size

_JSON_VERSION = 1


class LayoutError(ValueError):
    """A layout breaks one of the three constraints (raised by `Layout.validate`)."""


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a group lives in one evenly sharded buffer.

    Attributes:
        world_size: Number of ranks m sharing the buffer.
        shard_size: Elements per rank, S (a multiple of `align`).
        tensors: The group's tensors in the caller's order.
        starts: Global start offset of each tensor, aligned with `tensors`.
        align: Alignment of S in elements.

    Example:
        >>> from shard_planner import TensorSpec, plan_layout
        >>> layout = plan_layout([TensorSpec("a", 6, block=2), TensorSpec("b", 4)], world_size=2)
        >>> layout.shard_size, layout.local_units("a")
        (6, (3, 0))
    """

    world_size: int
    shard_size: int
    tensors: tuple[TensorSpec, ...]
    starts: tuple[int, ...]
    align: int = 1
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", check_world_size("world_size", self.world_size))
        object.__setattr__(self, "shard_size", check_count("shard_size", self.shard_size, 0))
        object.__setattr__(self, "align", check_count("align", self.align, 1))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        for spec in self.tensors:
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"Layout.tensors must be TensorSpecs, got {spec!r}")
        object.__setattr__(
            self,
            "starts",
            tuple(
                check_count(f"offset of tensor {spec.name!r}", start, 0)
                for spec, start in zip(self.tensors, self.starts, strict=False)
            ),
        )
        if len(self.tensors) != len(self.starts):
            raise ValueError(
                f"Layout has {len(self.tensors)} tensors but {len(self.starts)} starts"
            )
        index = {spec.name: i for i, spec in enumerate(self.tensors)}
        if len(index) != len(self.tensors):
            names = [spec.name for spec in self.tensors]
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"Layout tensor names must be unique, duplicated: {dupes}")
        object.__setattr__(self, "_index", MappingProxyType(index))
        self.validate()  # a hand-built layout is checked like a planned one

    # -- sizes ------------------------------------------------------------------------------

    @property
    def total_numel(self) -> int:
        """Sum of the tensors' element counts."""
        return sum(spec.numel for spec in self.tensors)

    @property
    def buffer_numel(self) -> int:
        """Elements of the global buffer, `world_size * shard_size`."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        """Padding elements in the global buffer: m * S - sum(numel)."""
        return self.buffer_numel - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the tensors' elements (0.0 for an empty group)."""
        total = self.total_numel
        return self.padding / total if total else 0.0

    @cached_property
    def lower_bound(self) -> int:
        """The smallest shard size any valid layout of these tensors could have.

        See `shard_planner.lower_bound` for the definition.
        """
        return lower_bound(self.tensors, self.world_size, align=self.align)

    # -- per tensor -------------------------------------------------------------------------

    @cached_property
    def offsets(self) -> Mapping[str, int]:
        """Global start offset of every tensor, by name (read-only)."""
        return MappingProxyType({s.name: o for s, o in zip(self.tensors, self.starts, strict=True)})

    def spec(self, name: str) -> TensorSpec:
        """Returns the TensorSpec named `name`; raises KeyError listing valid names if absent."""
        try:
            return self.tensors[self._index[name]]
        except KeyError:
            valid = ", ".join(sorted(self._index)[:8])
            more = "" if len(self._index) <= 8 else f", ... ({len(self._index)} in all)"
            raise KeyError(
                f"no tensor named {name!r} in this layout; valid: {valid}{more}"
            ) from None

    def unit(self, name: str) -> int:
        """Elements per RaggedShard unit of tensor `name`: gcd(block, numel)."""
        return self.spec(name).unit

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """The piece of tensor `name` on `rank`, in that rank's local coordinates [0, S).

        Returns (0, 0) when the rank holds none of it.
        """
        check_count("rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        spec = self.spec(name)
        start = self.offsets[name]
        base = rank * self.shard_size
        lo = max(start, base)
        hi = min(start + spec.numel, base + self.shard_size)
        return (lo - base, hi - base) if lo < hi else (0, 0)

    def local_rows(self, name: str, rank: int) -> tuple[int, int]:
        """The rows [start, stop) of tensor `name` (a row: one index of dim 0) that `rank` holds.

        Needs the tensor's shape; returns (0, 0) when the rank holds none of it.

        Raises:
            ValueError: The tensor has no shape, or the rank's piece cuts a row (its block is
                smaller than a row), so no whole rows describe it.

        Example:
            >>> from shard_planner import TensorSpec, plan_layout
            >>> layout = plan_layout([TensorSpec.from_shape("w", (10, 4))], world_size=3)
            >>> [layout.local_rows("w", rank) for rank in range(3)]
            [(0, 4), (4, 8), (8, 10)]
        """
        spec = self.spec(name)
        lo, hi = self.local_range(name, rank)
        if lo == hi:
            return (0, 0)
        if not spec.shape:
            raise ValueError(f"tensor {name!r} has no shape (give one to TensorSpec)")
        row = spec.numel // spec.shape[0]
        start = rank * self.shard_size + lo - self.offsets[name]
        stop = start + hi - lo
        if start % row or stop % row:
            raise ValueError(
                f"rank {rank}'s piece of {name!r}, elements [{start}, {stop}), cuts a row of "
                f"{row} elements (its block is {spec.block} elements)"
            )
        return (start // row, stop // row)

    def local_units(self, name: str) -> tuple[int, ...]:
        """Units of tensor `name` in each rank's range; usable as RaggedShard local_units.

        Example:
            >>> from shard_planner import TensorSpec, plan_layout
            >>> plan_layout([TensorSpec("w", 8, block=2)], world_size=4).local_units("w")
            (1, 1, 1, 1)
        """
        spec = self.spec(name)
        unit, start, size = spec.unit, self.offsets[name], self.shard_size
        units = [0] * self.world_size
        if spec.numel == 0:
            return tuple(units)
        end = start + spec.numel
        for rank in range(start // size, (end - 1) // size + 1):
            piece = min(end, (rank + 1) * size) - max(start, rank * size)
            units[rank] = piece // unit
        return tuple(units)

    # -- checks -----------------------------------------------------------------------------

    def validate(self) -> None:
        """Re-checks every constraint; raises LayoutError naming the tensor and boundary.

        1. non-sharded block: each boundary k*S strictly inside a tensor is a block boundary;
        2. contiguous tensor memory: tensors are disjoint intervals inside the buffer;
        3. balanced load: S is a multiple of align and large enough for every tensor.
        """
        size, m = self.shard_size, self.world_size
        if m < 1 or self.align < 1 or size < 0:
            raise LayoutError(
                f"world_size and align must be >= 1 and shard_size >= 0, got "
                f"world_size={m}, align={self.align}, shard_size={size}"
            )
        if size % self.align:
            raise LayoutError(f"shard_size {size} is not a multiple of align {self.align}")
        if size == 0 and self.total_numel:
            raise LayoutError("shard_size is 0 but the tensors hold elements")
        order = sorted(range(len(self.tensors)), key=lambda i: (self.starts[i], i))
        prev_end, prev_name = 0, None
        for i in order:
            spec, start = self.tensors[i], self.starts[i]
            end = start + spec.numel
            if start < 0 or end > m * size:
                raise LayoutError(
                    f"tensor {spec.name!r} at [{start}, {end}) is outside the buffer "
                    f"[0, {m * size})"
                )
            if spec.numel and start < prev_end:
                raise LayoutError(
                    f"tensor {spec.name!r} at [{start}, {end}) overlaps {prev_name!r} "
                    f"which ends at {prev_end}"
                )
            if spec.numel:
                prev_end, prev_name = end, spec.name
                self._check_blocks(spec, start, end)

    def _check_blocks(self, spec: TensorSpec, start: int, end: int) -> None:
        size, atom = self.shard_size, spec.atom
        first = start // size + 1  # first boundary strictly after start
        last = (end - 1) // size  # last boundary strictly before end
        for k in (first, first + 1) if last > first else (first,):
            boundary = k * size
            if boundary < end and (boundary - start) % atom:
                raise LayoutError(
                    f"rank boundary {boundary} (rank {k}) cuts a block of tensor "
                    f"{spec.name!r} at [{start}, {end}) with block {spec.block}: offset "
                    f"{boundary - start} is not a multiple of {atom}"
                )
        # Boundaries are S apart, so after the first two every one is aligned iff these were.

    # -- serialisation ----------------------------------------------------------------------

    def to_json(self) -> str:
        """Serialises the layout to a JSON string (see `Layout.from_json`)."""
        return json.dumps(self.to_dict(), indent=1)

    def to_dict(self) -> dict[str, Any]:
        """The layout as a JSON-ready dict (what `to_json` writes).

        Each tensor carries its `local_units` per rank (what `RaggedShard(local_units=...)`
        takes), so another system can shard by the plan without this package; reading it
        back checks them against the offsets.
        """
        return {
            "version": _JSON_VERSION,
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "align": self.align,
            "tensors": [
                {
                    "name": s.name,
                    "numel": s.numel,
                    "block": s.block,
                    "offset": o,
                    **({"shape": list(s.shape)} if s.shape is not None else {}),
                    "local_units": list(self.local_units(s.name)),
                }
                for s, o in zip(self.tensors, self.starts, strict=True)
            ],
        }

    @classmethod
    def from_json(cls, text: str) -> Layout:
        """Parses a layout written by `to_json` and validates it.

        Raises:
            ValueError: the text is not valid layout JSON, or the layout breaks a constraint.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"layout JSON does not parse: {exc}") from None
        if isinstance(data, dict) and "groups" in data and "tensors" not in data:
            raise ValueError(
                f"this is a plan of {len(data['groups'])} group(s), not one layout: read it "
                "with shard_planner.load_plan (or pick one with `show --layout FILE --group`)"
            )
        if not isinstance(data, dict) or data.get("version") != _JSON_VERSION:
            raise ValueError(f"layout JSON must be an object with version {_JSON_VERSION}")
        try:
            entries: list[dict[str, Any]] = data["tensors"]
            tensors = tuple(
                TensorSpec(
                    e["name"],
                    e["numel"],
                    e["block"],
                    shape=tuple(e["shape"]) if "shape" in e else None,
                )
                for e in entries
            )
            layout = cls(
                world_size=data["world_size"],
                shard_size=data["shard_size"],
                tensors=tensors,
                starts=tuple(e["offset"] for e in entries),
                align=data["align"],
            )
        except (KeyError, TypeError) as exc:
            hint = ""
            if "version" not in data or "tensors" not in data:
                hint = " (a plan of several groups, as `plan --out` writes, is read by load_plan)"
            raise ValueError(f"layout JSON is missing or mistypes a field: {exc!r}{hint}") from None
        for entry in entries:
            given = entry.get("local_units")
            if given is not None and tuple(given) != layout.local_units(entry["name"]):
                raise ValueError(
                    f"layout JSON: tensor {entry['name']!r} has local_units {given}, but its "
                    f"offset gives {list(layout.local_units(entry['name']))}"
                )
        return layout


def dump_plan(layouts: Mapping[str, Layout]) -> str:
    """One JSON document for the layouts of several groups, by group name (`plan --out`).

    Example:
        >>> from shard_planner import TensorSpec, load_plan, plan_layout
        >>> text = dump_plan({"g": plan_layout([TensorSpec("w", 8)], world_size=2)})
        >>> load_plan(text)["g"].shard_size
        4
    """
    given: object = layouts  # callers may pass anything; check before trusting the hint
    if not isinstance(given, Mapping) or not all(
        isinstance(name, str) and isinstance(layout, Layout) for name, layout in given.items()
    ):
        raise TypeError(f"dump_plan takes a mapping of group name to Layout, got {layouts!r}")
    return json.dumps(
        {"version": _JSON_VERSION, "groups": {n: v.to_dict() for n, v in layouts.items()}},
        indent=1,
    )


def load_plan(text: str) -> dict[str, Layout]:
    """Reads what `dump_plan` (or `plan --out`) wrote; a single layout's JSON also reads.

    Raises:
        ValueError: The text is neither, or a layout breaks a constraint (named).
        TypeError: `text` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"load_plan takes the JSON text, got {type(text).__name__}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan JSON does not parse: {exc}") from None
    if isinstance(data, dict) and "tensors" in data:
        return {"layout": Layout.from_json(text)}
    if not isinstance(data, dict) or not isinstance(data.get("groups"), dict):
        raise ValueError("plan JSON must be an object with a 'groups' object (see dump_plan)")
    layouts = {}
    for name, layout in data["groups"].items():
        try:
            layouts[name] = Layout.from_json(json.dumps(layout))
        except ValueError as exc:
            raise ValueError(f"group {name!r}: {exc}") from None
    return layouts
