"""Model presets and group files: tensor shapes grouped the way FSDP wraps a model.

A group file is JSON. Either a model document, as shipped in `presets/`::

    {"name": "...", "config": {...}, "groups": [
        {"name": "embed", "tensors": [{"name": "model.embed_tokens.weight", "shape": [V, H]}]},
        {"name": "model.layers.{i}", "indices": [0, 32], "tensors": [...]}]}

where a group with `indices` [start, stop) stands for one group per layer i (its tensor names
get the prefix "<group name>."), or a single group ``{"tensors": [...]}``. A tensor is either
``{"name", "shape", "num_shard_dims"?}`` (its block is `block_rows` rows, see
`TensorSpec.from_shape`) or ``{"name", "numel", "block"?}`` (a fixed block in elements).
Unknown keys, duplicate group names and contradictions (a shape and a numel that disagree) are
errors, never ignored.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

from shard_planner._spec import TensorSpec


class _Entry(NamedTuple):
    name: str
    shape: tuple[int, ...] | None
    numel: int
    block: int
    num_shard_dims: int
    pattern: str = ""  # the name with its digits out (what layout keys compare); "" = not yet

    def key(self) -> tuple[object, ...]:
        pattern = self.pattern or _DIGITS.sub("#", self.name)
        return (pattern, self.shape, self.numel, self.block, self.num_shard_dims)


@dataclass(frozen=True)
class GroupSpec:
    """One FSDP group of a model: named tensors whose block depends on `block_rows`.

    Example:
        >>> group = load_preset("llama3-8b").groups[1]
        >>> group.name, group.specs(block_rows=32)[0].block
        ('model.layers.0', 131072)
    """

    name: str
    entries: tuple[_Entry, ...]

    def __hash__(self) -> int:
        # Computed once: groups key the planner's caches, and a layer has thousands of
        # entries to hash.
        return self._hash

    def __eq__(self, other: object) -> bool:
        # The caches look groups up by equal copies (a block's expert groups are rebuilt at
        # each split): the hashes tell most apart, and copies share their entries.
        if self is other:
            return True
        if not isinstance(other, GroupSpec):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.name == other.name
            and (self.entries is other.entries or self.entries == other.entries)
        )

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.name, self.entries))

    @classmethod
    def from_shapes(
        cls,
        name: str,
        shapes: Mapping[str, Sequence[int]],
        *,
        num_shard_dims: Mapping[str, int] | None = None,
    ) -> GroupSpec:
        """A group from tensor names and shapes (what `fully_shard` of one module would hold).

        Args:
            name: The group's name (e.g. "model.layers.0").
            shapes: Tensor name (e.g. the parameter's FQN) to shape, in the group's order.
            num_shard_dims: Per tensor, how many leading dims a shard may cut (default 1:
                whole rows of `shape[1:]`), as `TensorSpec.from_shape`.

        Returns:
            The group; its blocks follow `block_rows` (`specs(block_rows)`).

        Raises:
            ValueError: No tensors, a tensor without elements, or `num_shard_dims` naming a
                tensor that is not in `shapes`.

        Example:
            >>> group = GroupSpec.from_shapes("layer", {"wq": (4096, 4096), "norm": (4096,)})
            >>> group.numel, group.specs(block_rows=32)[0].block
            (16781312, 131072)
        """
        dims = dict(num_shard_dims or {})
        unknown = sorted(set(dims) - set(shapes))
        if unknown:
            raise ValueError(f"num_shard_dims names {unknown}, which are not in shapes")
        raw = [
            {"name": t, "shape": list(shape), **({"num_shard_dims": dims[t]} if t in dims else {})}
            for t, shape in shapes.items()
        ]
        if not raw:
            raise ValueError(f"group {name!r} has no tensors")
        return cls(str(name), tuple(_parse_entry(r, f"group {name!r}") for r in raw))

    def specs(self, block_rows: int = 1) -> tuple[TensorSpec, ...]:
        """TensorSpecs with blocks of `block_rows` rows (fixed-block entries keep theirs)."""
        return tuple(
            TensorSpec.from_shape(e.name, e.shape, block_rows, num_shard_dims=e.num_shard_dims)
            if e.shape is not None
            else TensorSpec(e.name, e.numel, e.block)
            for e in self.entries
        )

    @functools.cached_property
    def numel(self) -> int:
        """Elements in the group."""
        return sum(e.numel for e in self.entries)

    @functools.cached_property
    def layout_key(self) -> tuple[object, ...]:
        """What the group's layout depends on: its entries, with digits out of their names.

        Repeated layers (same tensors, other indices) and a layer's expert groups of equal
        size share it, so a model's distinct layouts are planned once. The names stay (an
        optimizer may treat an embedding apart), their indices do not. Computed once.
        """
        key = tuple(e.key() for e in self.entries)
        return _LAYOUT_KEYS.setdefault(key, key)

    @functools.cached_property
    def layout_id(self) -> int:
        """A number for `layout_key`, equal for groups with equal keys (cheap to look up)."""
        return id(self.layout_key)


_DIGITS = re.compile(r"\d+")
# One object per distinct layout key (what `layout_id` numbers): a planner run compares
# thousands of groups' keys per estimate, and comparing numbers is what makes that cheap.
_LAYOUT_KEYS: dict[tuple[object, ...], tuple[object, ...]] = {}


@dataclass(frozen=True)
class ModelPreset:
    """A model's FSDP groups, in wrapping order (embedding, blocks, final norm + head)."""

    name: str
    source: str
    config: Mapping[str, Any]
    groups: tuple[GroupSpec, ...]

    @property
    def numel(self) -> int:
        """Parameters in the model."""
        return sum(g.numel for g in self.groups)


def preset_names() -> tuple[str, ...]:
    """Names of the presets shipped with the package, e.g. "llama3-8b"."""
    folder = resources.files("shard_planner") / "presets"
    return tuple(sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json")))


def load_preset(name: str) -> ModelPreset:
    """Loads a shipped model preset.

    Args:
        name: One of `preset_names()`.

    Returns:
        The preset, with one GroupSpec per FSDP group.

    Raises:
        ValueError: `name` is not a shipped preset (the message lists the valid ones).

    Example:
        >>> preset = load_preset("deepseek-v3-671b")
        >>> len(preset.groups), round(preset.numel / 1e9)
        (63, 671)
    """
    names = preset_names()
    if name not in names:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(names)}")
    text = (resources.files("shard_planner") / "presets" / f"{name}.json").read_text()
    return parse_model(text, origin=f"preset {name}")


MAX_REPEATED_GROUPS = 100_000  # far above any model's layer count; a typo is caught early

_MODEL_KEYS = ("name", "source", "config", "groups", "tensors")
_GROUP_KEYS = ("name", "indices", "tensors")
_TENSOR_KEYS = ("name", "shape", "num_shard_dims", "numel", "block")


def load_group_file(path: str | os.PathLike[str]) -> ModelPreset:
    """Reads a group file (the JSON format of the module docstring, as `plan FILE` takes).

    Args:
        path: The file.

    Returns:
        The model, one GroupSpec per group.

    Raises:
        ValueError: The file cannot be read, is not JSON, or does not describe tensors
            correctly (the message names the group and tensor).

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "model.json"
        >>> _ = path.write_text(json.dumps({"tensors": [{"name": "w", "shape": [8, 4]}]}))
        >>> load_group_file(path).groups[0].specs(block_rows=2)[0].block
        8
    """
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    return parse_model(text, origin=str(path))


def parse_model(text: str, *, origin: str = "group file") -> ModelPreset:
    """Parses a model document or a single-group document (see the module docstring).

    Args:
        text: The JSON text.
        origin: Where it came from, for error messages.

    Returns:
        The model, one GroupSpec per group.

    Raises:
        ValueError: the text is not valid JSON or does not describe tensors correctly.

    Example:
        >>> doc = '{"groups": [{"name": "l.{i}", "indices": [0, 2], "tensors": '
        >>> doc += '[{"name": "w", "shape": [8, 4]}]}]}'
        >>> [g.name for g in parse_model(doc).groups]
        ['l.0', 'l.1']
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{origin}: expected a JSON object, got {type(doc).__name__}")
    _check_keys(doc, _MODEL_KEYS, origin)
    if "groups" in doc and "tensors" in doc:
        raise ValueError(f"{origin}: give 'groups' or 'tensors', not both")
    if "groups" in doc:
        raw_groups = doc["groups"]
    elif "tensors" in doc:
        raw_groups = [{"name": doc.get("name", "group"), "tensors": doc["tensors"]}]
    else:
        raise ValueError(f"{origin}: expected a 'groups' or a 'tensors' key")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise ValueError(f"{origin}: 'groups' must be a non-empty list")
    groups: list[GroupSpec] = []
    for raw in raw_groups:
        groups += _parse_group(raw, origin)
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{origin}: group names must be unique, repeated: {dupes[:6]}")
    config = doc.get("config", {})
    return ModelPreset(
        str(doc.get("name", origin)), str(doc.get("source", "")), config, tuple(groups)
    )


def _parse_group(raw: Any, origin: str) -> list[GroupSpec]:
    if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), list):
        raise ValueError(f"{origin}: each group must be an object with a 'tensors' list")
    name = raw.get("name", "group")
    _check_keys(raw, _GROUP_KEYS, f"{origin}, group {name!r}")
    entries = tuple(_parse_entry(t, f"{origin}, group {name!r}") for t in raw["tensors"])
    empty = f"{origin}, group {name!r}: 'tensors' is empty; a group has tensors"
    if "indices" not in raw:
        if not entries:
            raise ValueError(empty)
        return [GroupSpec(str(name), entries)]
    indices = raw["indices"]
    if (
        not isinstance(indices, list)
        or len(indices) != 2
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
        or not 0 <= indices[0] < indices[1]
    ):
        raise ValueError(
            f"{origin}, group {name!r}: 'indices' must be [start, stop), 0 <= start < stop"
        )
    if indices[1] - indices[0] > MAX_REPEATED_GROUPS:
        raise ValueError(
            f"{origin}, group {name!r}: 'indices' {indices} repeat the group "
            f"{indices[1] - indices[0]:,} times; at most {MAX_REPEATED_GROUPS:,} are allowed"
        )
    if "{i}" not in str(name):
        raise ValueError(
            f"{origin}, group {name!r}: a group with 'indices' needs '{{i}}' in its name"
        )
    if not entries:
        raise ValueError(empty)
    groups = []
    pattern = _DIGITS.sub("#", str(name).replace("{i}", "0"))  # each repeat's, computed once
    for i in range(*indices):
        prefix = str(name).replace("{i}", str(i))
        groups.append(
            GroupSpec(
                prefix,
                tuple(
                    e._replace(name=f"{prefix}.{e.name}", pattern=f"{pattern}.{e.key()[0]}")
                    for e in entries
                ),
            )
        )
    return groups


def _parse_entry(raw: Any, where: str) -> _Entry:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ValueError(
            f"{where}: each tensor must be an object with a 'name' string, got {raw!r}"
        )
    name = raw["name"]
    _check_keys(raw, _TENSOR_KEYS, f"{where}, tensor {name!r}")
    try:
        if "shape" in raw:
            shape = raw["shape"]
            if not isinstance(shape, list):
                raise ValueError(f"shape must be a list of ints, got {shape!r}")
            if "block" in raw:
                raise ValueError(
                    "'block' is for a 'numel' tensor; a 'shape' tensor's block is block_rows "
                    "rows (use num_shard_dims to choose what a row is)"
                )
            if 0 in shape:
                raise ValueError(
                    f"shape {shape} has no elements: a model's tensor has at least one "
                    f"(drop it, or fix the shape)"
                )
            dims = raw.get("num_shard_dims", 1)
            spec = TensorSpec.from_shape(name, shape, num_shard_dims=dims)
            if "numel" in raw and raw["numel"] != spec.numel:
                raise ValueError(
                    f"numel {raw['numel']!r} disagrees with shape {shape} ({spec.numel} "
                    "elements); give one of them"
                )
            return _Entry(name, spec.shape, spec.numel, 1, dims)
        if "num_shard_dims" in raw:
            raise ValueError("'num_shard_dims' needs a 'shape'")
        if "numel" in raw:
            spec = TensorSpec(name, raw["numel"], raw.get("block", 1))
            if not spec.numel:
                raise ValueError("numel is 0: a model's tensor has at least one element")
            return _Entry(name, None, spec.numel, spec.block, 1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}, tensor {name!r}: {exc}") from None
    raise ValueError(f"{where}, tensor {name!r}: needs 'shape' or 'numel'")


def _check_keys(raw: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(valid)}")
