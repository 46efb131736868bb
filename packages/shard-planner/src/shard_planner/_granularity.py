"""Group granularity: a MoE layer's experts as FSDP groups of their own.

A model's groups follow how FSDP wraps it, one per transformer block. A MoE block is mostly
experts, and gathering it whole (twice, with the next block prefetched) can take more memory
than the sharded state itself. Wrapping the experts apart (`fully_shard` on a list of expert
modules before the block) makes smaller groups: the block's other parameters (attention,
router, norms, shared experts) stay one group, and its experts become `k` groups of
consecutive experts. Experts are found by name: `<...>.experts.<index>.<...>` (one module per
expert; any `k` up to their count) or `<...>.experts.<name>` (fused tensors of all experts:
only `k = 1`, the experts module alone).
"""

from __future__ import annotations

import functools
import itertools
import keyword
import re
from collections import OrderedDict
from collections.abc import Sequence

from shard_planner._presets import GroupSpec, _Entry

_PER_EXPERT = re.compile(r"^(?P<owner>.*\.experts)\.(?P<index>\d+)\.")
_FUSED = re.compile(r"^(?P<owner>.*\.experts)\.[^.]+$")


def split_experts(groups: Sequence[GroupSpec], num_groups: int) -> tuple[GroupSpec, ...] | None:
    """The groups with each one's experts in `num_groups` groups of their own (0: as given).

    Each group with experts becomes its other tensors (first, as forward runs them) then the
    expert groups, named `<experts module>[lo:hi]`.

    Args:
        groups: The model's groups, one per wrapped block.
        num_groups: Expert groups per block; 0 keeps the groups as they are.

    Returns:
        The new groups, or None when some block cannot be split so (fused experts and
        `num_groups > 1`, or fewer experts than `num_groups`).

    Example:
        >>> layer = GroupSpec.from_shapes("l", {f"l.mlp.experts.{e}.w": (4, 8) for e in range(4)}
        ...                               | {"l.attn.w": (8, 8)})
        >>> [g.name for g in split_experts([layer], 2)]
        ['l', 'l.mlp.experts[0:2]', 'l.mlp.experts[2:4]']
    """
    if num_groups == 0:
        return tuple(groups)
    out: list[GroupSpec] = []
    for group in groups:
        split = _split(group, num_groups)
        if split is None:
            return None
        out += split
    return tuple(out)


def has_experts(groups: Sequence[GroupSpec]) -> int:
    """The most experts one group holds (per-expert modules; 1 for fused ones, 0 for none)."""
    most = 0
    for group in groups:
        _, per_expert, fused, _ = classify(group)  # one reading of the names (cached)
        most = max(most, len(per_expert) or int(bool(fused)))
    return most


def num_experts(groups: Sequence[GroupSpec]) -> int:
    """The most routed experts one group holds (0 for a dense model).

    Per-expert modules are counted; a fused tensor holds its leading (expert) dim.

    Example:
        >>> group = GroupSpec.from_shapes("l.0", {"l.0.mlp.experts.down_proj": (8, 4, 2)})
        >>> num_experts([group])
        8
    """
    most = 0
    for group in groups:
        _, per_expert, fused, _ = classify(group)
        shapes = [e.shape[0] for e in fused if e.shape]
        most = max(most, len(per_expert), *shapes)
    return most


def dense_blocks(groups: Sequence[GroupSpec]) -> list[bool]:
    """Which groups are a MoE model's dense blocks: a block index no expert group shares.

    Example:
        >>> blocks = [GroupSpec.from_shapes(f"l.{i}", {f"l.{i}.mlp.w": (8, 8)}) for i in (0,)]
        >>> blocks += [GroupSpec.from_shapes("l.1", {"l.1.mlp.experts.0.w": (8, 8)})]
        >>> dense_blocks(blocks)
        [True, False]
    """
    with_experts = set()
    for group in groups:
        _, per_expert, fused, _ = classify(group)
        if per_expert or fused:
            with_experts.add(block_index(group.name))
    if not with_experts:
        return [False] * len(groups)
    out = []
    for group in groups:
        index = block_index(group.name)
        out.append(index is not None and index not in with_experts)
    return out


# The same split objects for the same group: every cache keyed by groups (layouts,
# activations, FLOPs) then finds them by identity, not by comparing thousands of entries.
@functools.lru_cache(maxsize=8192)
def _split(group: GroupSpec, num_groups: int) -> tuple[GroupSpec, ...] | None:
    rest, per_expert, fused, owner = classify(group)
    if not per_expert and not fused:
        return (group,)
    head = [_known(GroupSpec(group.name, rest), (rest, {}, (), ""))] if rest else []
    if fused:
        if num_groups > 1:
            return None
        return (*head, _known(GroupSpec(owner, fused), ((), {}, fused, owner)))
    indices = sorted(per_expert)
    if num_groups > len(indices):
        return None
    chunks = []
    for i in range(num_groups):
        lo, hi = len(indices) * i // num_groups, len(indices) * (i + 1) // num_groups
        mine = {index: per_expert[index] for index in indices[lo:hi]}
        entries = tuple(e for experts in mine.values() for e in experts)
        chunk = GroupSpec(f"{owner}[{indices[lo]}:{indices[hi - 1] + 1}]", entries)
        chunks.append(_known(chunk, ((), mine, (), owner)))
    return (*head, *chunks)


Classified = tuple[tuple[_Entry, ...], dict[int, list[_Entry]], tuple[_Entry, ...], str]
# Groups classified, most recent last: the splits of a group are known from it without
# matching their names again (advise splits every block at several granularities).
_CLASSIFIED: OrderedDict[GroupSpec, Classified] = OrderedDict()
_MAX_CLASSIFIED = 8192


def _known(group: GroupSpec, classified: Classified) -> GroupSpec:
    _CLASSIFIED[group] = classified
    if len(_CLASSIFIED) > _MAX_CLASSIFIED:
        _CLASSIFIED.popitem(last=False)
    return group


def classify(group: GroupSpec) -> Classified:
    """(other entries, entries per expert index, fused expert entries, experts module)."""
    known = _CLASSIFIED.get(group)
    if known is not None:
        return known
    rest: list[_Entry] = []
    per_expert: dict[int, list[_Entry]] = {}
    fused: list[_Entry] = []
    owner = ""
    for entry in group.entries:
        if match := _PER_EXPERT.match(entry.name):
            per_expert.setdefault(int(match["index"]), []).append(entry)
            owner = match["owner"]
        elif match := _FUSED.match(entry.name):
            fused.append(entry)
            owner = match["owner"]
        else:
            rest.append(entry)
    if per_expert and fused:  # both kinds under one block: keep the fused ones with the rest
        rest += fused
        fused = []
    _known(group, (tuple(rest), per_expert, tuple(fused), owner))
    return _CLASSIFIED[group]


def fully_shard_calls(
    groups: Sequence[GroupSpec],
    root: str = "model",
    *,
    experts_mesh: str | None = None,
    dense_mesh: str | None = None,
) -> list[str]:
    """Python that makes `groups` with `fully_shard`, bottom-up, repeated blocks as loops.

    Tensor names are FQNs under the module `root` names (`model.layers.0.attn.w` is
    `root.model.layers[0].attn`). A group is its block (the group's name, when it prefixes
    every tensor; else the deepest module holding them all, or each tensor's module:
    `[model.norm, lm_head]`); an expert group is the list of its experts, sharded before
    its block; blocks with the same calls up to their index are one `for i in ...` loop.
    The lines run as they are with `root` and `fully_shard` (with its mesh and block_rows
    bound) in scope. Under expert parallelism, give the groups one rank holds
    (`expert_groups_under_ep`) and the name of the mesh of the ranks holding the same experts
    as `experts_mesh`: the expert groups' calls pass it (`mesh=experts_mesh`). With
    `dense_mesh`, a MoE model's dense blocks (`dense_blocks`) pass that mesh.

    Example:
        >>> layers = [GroupSpec.from_shapes(f"layers.{i}", {
        ...     f"layers.{i}.attn.w": (8, 8), f"layers.{i}.mlp.experts.0.w": (4, 8),
        ...     f"layers.{i}.mlp.experts.1.w": (4, 8)}) for i in range(3)]
        >>> for line in fully_shard_calls(split_experts(layers, 2)):
        ...     print(line)
        for i in range(0, 3):
            for lo in range(0, 2, 1):
                fully_shard([model.layers[i].mlp.experts[j] for j in range(lo, lo + 1)])
            fully_shard(model.layers[i])
        fully_shard(model)
    """
    blocks: list[tuple[str, str, list[tuple[str, int, int]]]] = []  # name, own call, chunks
    mesh = f", mesh={experts_mesh}" if experts_mesh else ""
    dense = dense_blocks(groups) if dense_mesh else [False] * len(groups)
    for group, apart in zip(groups, dense, strict=True):
        chunk = re.fullmatch(r"(?P<owner>.*\.experts)\[(?P<lo>\d+):(?P<hi>\d+)\]", group.name)
        if chunk and blocks:
            blocks[-1][2].append((chunk["owner"], int(chunk["lo"]), int(chunk["hi"])))
            continue
        modules = [f"{root}.{m}" for m in _modules(group)]  # _modules gives Python paths
        target = modules[0] if len(modules) == 1 else "[" + ", ".join(modules) + "]"
        if group.name.endswith(".experts") and blocks:  # fused experts: sharded before it
            blocks[-1][2].append((f"fully_shard({target}{mesh})", -1, -1))
            continue
        own = f"fully_shard({target}, mesh={dense_mesh})" if apart else f"fully_shard({target})"
        blocks.append((group.name, own, []))
    # Blocks with the same calls up to their index form one loop over their indices.
    patterns: dict[tuple[str, ...], list[str]] = {}
    for name, own, chunks in blocks:
        patterns.setdefault((*_chunk_calls(chunks, root, mesh), own), []).append(name)
    lines: list[str] = []
    for calls, names in patterns.items():
        indices = [block_index(name) for name in names]
        if len(names) == 1:
            index = indices[0]
            lines += [
                c if index is None else c.replace("[i]", f"[{index}]").replace("{i}", str(index))
                for c in calls
            ]
            continue
        numbers = [i for i in indices if i is not None]
        if len(numbers) != len(names):  # groups repeated without an index: as they come
            lines += [c for _ in names for c in calls]
            continue
        if numbers == list(range(numbers[0], numbers[-1] + 1)):
            lines.append(f"for i in range({numbers[0]}, {numbers[-1] + 1}):")
        else:
            lines.append(f"for i in {tuple(numbers)}:")
        lines += [f"    {line}" for call in calls for line in call.split("\n")]
    return [*lines, f"fully_shard({root})"]


def _chunk_calls(chunks: list[tuple[str, int, int]], root: str, mesh: str) -> list[str]:
    """A block's expert groups: one call each, or one loop when they are equal."""
    if not chunks:
        return []
    if chunks[0][1] < 0:  # fused experts: the call itself
        return [chunks[0][0]]
    owner = f"{root}.{_path(chunks[0][0])}"
    sizes = {hi - lo for _, lo, hi in chunks}
    contiguous = all(a[2] == b[1] for a, b in itertools.pairwise(chunks))
    if len(sizes) == 1 and contiguous and len(chunks) > 1:
        (size,) = sizes
        return [
            f"for lo in range({chunks[0][1]}, {chunks[-1][2]}, {size}):\n"
            f"    fully_shard([{owner}[j] for j in range(lo, lo + {size})]{mesh})"
        ]
    return [f"fully_shard([{owner}[j] for j in range({lo}, {hi})]{mesh})" for _, lo, hi in chunks]


@functools.lru_cache(maxsize=65536)  # every estimate asks for every group's
def block_index(name: str) -> int | None:
    """The block index in a group name (`model.layers.7`, `layers.7.mlp.experts[0:4]` -> 7)."""
    found = re.findall(r"\.(\d+)(?=\.|$)", name)
    return int(found[-1]) if found else None


def _modules(group: GroupSpec) -> list[str]:
    names = [e.name for e in group.entries]
    if all(n.startswith(group.name + ".") for n in names):
        return [_path(group.name)]
    parents = [n.rpartition(".")[0] for n in names]
    common = parents[0]
    for parent in parents[1:]:
        while common and not (parent == common or parent.startswith(common + ".")):
            common = common.rpartition(".")[0]
    if common:
        return [_path(common)]
    return list(dict.fromkeys(_path(p) for p in parents))


def _path(dotted: str) -> str:
    """A module's dotted name as Python, block indices generic: `model.layers[i].mlp`.

    A name that is not attribute access (`norm-1`, a keyword) goes through `get_submodule`,
    so that the printed code runs as is.
    """
    parts = dotted.split(".")
    if all(p.isdigit() or (p.isidentifier() and not keyword.iskeyword(p)) for p in parts):
        return re.sub(r"\.(\d+)(?=\.|$)", "[i]", dotted)
    escaped = dotted.replace("{", "{{").replace("}", "}}")
    generic = re.sub(r"(?<=\.)\d+(?=\.|$)", "{i}", escaped)
    return f"get_submodule(f{generic!r})" if "{i}" in generic else f"get_submodule({dotted!r})"
