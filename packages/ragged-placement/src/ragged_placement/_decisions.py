"""Sharding decisions for ops on RaggedShard DTensors, cached so that a step computes none.

Deciding an op's sharding runs fake-tensor shape propagation (~0.1 ms per op, more for long
lists), so decisions are cached as torch caches its own: by the op schema (the inputs' specs
and the static arguments). For `_foreach_*` ops that alone is not enough: their schema holds
one spec per list entry, and the list changes whenever the set of parameters with a gradient
does (MoE experts that got no token in a step have none). Every entry of an elementwise or
norm foreach op is decided on its own, so a foreach op is answered from a cache of one-entry
("column") decisions, and fake propagation runs only for a column never seen. Columns are
found by the entries' identity first: equal specs of distinct parameters would otherwise cost
a Python `__eq__` and `__hash__` per entry (DTensorSpec's run in Python).

The whole-schema cache is bounded (least recently used entries go first), and so is the
identity table (cleared when full; the columns by value stay).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ragged_placement._compat import DTensorSpec, OpSchema, OutputSharding
from ragged_placement._ops import has_ragged, is_columnwise, propagate

aten = torch.ops.aten

TensorMetaFn = Callable[[OpSchema], Any]


class ShardingDecisions:
    """Cached `propagate` (see the module docstring).

    Args:
        max_schemas: Whole schemas kept (least recently used dropped first).
        max_columns_by_id: Foreach entries remembered by identity (all dropped when full).
    """

    def __init__(self, max_schemas: int = 2048, max_columns_by_id: int = 1 << 16) -> None:
        self.max_schemas = max_schemas
        self.max_columns_by_id = max_columns_by_id
        self._schemas: OrderedDict[OpSchema, OutputSharding] = OrderedDict()
        # Per static key (op and non-list arguments): column key -> decision.
        self._columns: dict[Hashable, dict[Hashable, _Column]] = {}
        # The same by the column key's identity: many parameters' specs are equal but distinct
        # objects, and DTensorSpec's __eq__ and __hash__ run in Python. `id(key) -> key` keeps
        # each key alive while it is here, so an id cannot be reused for another object.
        self._keys_by_id: dict[Hashable, dict[object, object]] = {}
        self._columns_by_id: dict[Hashable, dict[object, _Column]] = {}
        self._num_by_id = 0
        self.num_propagations = 0  # fake-tensor propagations run (for tests and benchmarks)

    def decide(
        self, schema: OpSchema, tensor_meta: TensorMetaFn, *, cacheable: bool = True
    ) -> OutputSharding:
        """The output sharding of `schema`; `cacheable` False (tracing) always propagates."""
        if not cacheable:
            return self._propagate(schema, tensor_meta)
        lists = _list_positions(schema)
        static = _static_key(schema, lists) if lists and is_columnwise(schema.op) else None
        if static is not None:
            # Straight to the columns: a whole foreach schema rarely repeats here (C++ answers
            # the ones that do), and hashing one costs a Python call per entry.
            sharding = self._by_column(schema, lists, static, tensor_meta)
            if sharding is not None:
                return sharding
        found = self._schemas.get(schema)
        if found is not None:
            self._schemas.move_to_end(schema)
            return found
        sharding = self._propagate(schema, tensor_meta)
        self._schemas[schema] = sharding
        if len(self._schemas) > self.max_schemas:
            self._schemas.popitem(last=False)
        return sharding

    def _propagate(self, schema: OpSchema, tensor_meta: TensorMetaFn) -> OutputSharding:
        self.num_propagations += 1
        return propagate(schema, tensor_meta)

    def _by_column(
        self,
        schema: OpSchema,
        lists: tuple[int, ...],
        static: Hashable,
        tensor_meta: TensorMetaFn,
    ) -> OutputSharding | None:
        """The decision joined from its columns', or None if a column has no RaggedShard."""
        args = schema.args_schema
        # No Python call per entry when every key was seen as this very object (C-level maps
        # and an identity-first list compare): this runs for every foreach op of an optimizer
        # step whose set of parameters changed.
        entries = [_keys_of(args[i]) for i in lists]  # type: ignore[arg-type]
        if len(entries) == 1:
            keys: list[Any] = list(entries[0])
            ids: list[Any] = list(map(id, keys))
        else:
            keys = list(zip(*entries, strict=True))
            ids = list(zip(*[map(id, e) for e in entries], strict=True))
        keys_by_id = self._keys_by_id.setdefault(static, {})
        if list(map(keys_by_id.get, ids)) == keys:
            return _join(schema, lists, list(map(self._columns_by_id[static].__getitem__, ids)))
        table = self._columns.setdefault(static, {})
        columns: list[_Column | None] = list(map(table.get, keys))
        if None in columns:  # identity comparisons only: _Column compares by identity
            for index, column in enumerate(columns):
                if column is not None or (column := table.get(keys[index])) is not None:
                    columns[index] = column  # an equal entry earlier in this same list
                    continue
                if not any(has_ragged(args[i][index]) for i in lists):  # type: ignore[index]
                    return None  # torch's own rule decides this entry: not per column
                one = tuple([a[index]] if i in lists else a for i, a in enumerate(args))  # type: ignore[index]
                single = OpSchema(
                    schema.op, one, schema.kwargs_schema, schema_info=schema.schema_info
                )
                columns[index] = table[keys[index]] = _Column.of(
                    single, lists, self._propagate(single, tensor_meta)
                )
        if self._num_by_id + len(ids) > self.max_columns_by_id:
            self._keys_by_id.clear()
            self._columns_by_id.clear()
            keys_by_id = self._keys_by_id.setdefault(static, {})
            self._num_by_id = 0
        columns_by_id = self._columns_by_id.setdefault(static, {})
        before = len(keys_by_id)
        keys_by_id.update(zip(ids, keys, strict=True))
        columns_by_id.update(zip(ids, columns, strict=True))  # type: ignore[arg-type]
        self._num_by_id += len(keys_by_id) - before
        return _join(schema, lists, columns) if columns else None  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class _Column:
    """The decision for one entry of a foreach op, and which of its specs must move.

    `moved[i]` is the spec argument i (its entry, for a list) is redistributed to, or None
    where it stays as given: a joined decision then keeps the caller's own spec objects,
    which torch compares by identity first.
    """

    sharding: OutputSharding
    moved: tuple[Any, ...]
    moved_kwargs: dict[str, Any]

    @staticmethod
    def of(single: OpSchema, lists: tuple[int, ...], sharding: OutputSharding) -> _Column:
        target = sharding.redistribute_schema
        if not sharding.needs_redistribute or target is None:
            return _Column(sharding, (None,) * len(single.args_schema), {})
        moved = []
        for position, given in enumerate(single.args_schema):
            wanted = target.args_schema[position]
            if position in lists:
                given, wanted = given[0], wanted[0]  # type: ignore[index]
            moved.append(
                wanted if isinstance(wanted, DTensorSpec) and wanted is not given else None
            )
        moved_kwargs = {
            k: v
            for k, v in target.kwargs_schema.items()
            if isinstance(v, DTensorSpec) and v is not single.kwargs_schema.get(k)
        }
        return _Column(sharding, tuple(moved), moved_kwargs)


def _list_positions(schema: OpSchema) -> tuple[int, ...]:
    """Positions of the list arguments that have one entry per tensor of the op."""
    lengths = {i: len(a) for i, a in enumerate(schema.args_schema) if isinstance(a, list | tuple)}
    if not lengths:
        return ()
    length = next(iter(lengths.values()))
    return tuple(i for i, n in lengths.items() if n == length)


def _join(schema: OpSchema, lists: tuple[int, ...], columns: list[_Column]) -> OutputSharding:
    """One foreach decision from its columns' (each for a one-entry list)."""
    first: Any = columns[0].sharding.output_spec
    output: Any = None
    if first is not None:
        specs: list[Any] = [column.sharding.output_spec for column in columns]
        output = [spec for column in specs for spec in column]
        if isinstance(first, tuple):
            output = tuple(output)
    if not any([column.sharding.needs_redistribute for column in columns]):
        return OutputSharding(output)
    # A list entry moves as its own column says; an operand outside the lists moves the same
    # way in every column (each column has a RaggedShard entry); scalars stay as given.
    args: list[object] = []
    for position, arg in enumerate(schema.args_schema):
        targets = [column.moved[position] for column in columns]
        if position in lists:
            entries = [t if t is not None else e for t, e in zip(targets, arg, strict=True)]  # type: ignore[call-overload]
            args.append(type(arg)(entries))  # type: ignore[call-arg]
        else:
            args.append(next((t for t in targets if t is not None), arg))
    kwargs = dict(schema.kwargs_schema)
    for column in columns:
        kwargs.update(column.moved_kwargs)
    target = OpSchema(schema.op, tuple(args), kwargs, schema_info=schema.schema_info)
    return OutputSharding(output, redistribute_schema=target, needs_redistribute=True)


def _key_of(value: object) -> object:
    """A value as far as a sharding decision can depend on it: numbers by their type only.

    An elementwise op's sharding does not depend on a scalar's value, and AdamW passes a
    different step size per parameter and step.
    """
    if isinstance(value, int | float | complex) and not isinstance(value, bool):
        return type(value)
    return value


def _keys_of(values: Sequence[object]) -> Sequence[object]:
    """`_key_of` of a foreach list's entries (a list is all tensors or all scalars)."""
    if values and _key_of(values[0]) is not values[0]:
        return [v.__class__ for v in values]  # numbers (a ScalarList): by type
    return values


def _static_key(schema: OpSchema, lists: tuple[int, ...]) -> Hashable | None:
    """What every column shares: the op, the other arguments and the kwargs.

    None when that cannot be shared per column: a tensor other than a 0-dim DTensor (a
    tensor of per-entry scalars), or a value that does not hash. A norm's order is kept as
    is (it chooses the partial placement); other numbers count by type (`_key_of`).
    """
    static = tuple(a for i, a in enumerate(schema.args_schema) if i not in lists)
    kwargs = tuple(sorted(schema.kwargs_schema.items()))
    for value in (*static, *(v for _, v in kwargs)):
        if isinstance(value, DTensorSpec):
            if value.ndim:
                return None
        elif isinstance(value, torch.Tensor | list | tuple | dict) or not isinstance(
            value, Hashable
        ):
            return None
    if schema.op is not aten._foreach_norm.Scalar:
        static = tuple(_key_of(a) for a in static)
        kwargs = tuple((k, _key_of(v)) for k, v in kwargs)
    return (schema.op, static, kwargs)
