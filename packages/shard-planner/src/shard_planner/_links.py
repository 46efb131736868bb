"""Link figures for the cost model, fitted from measured collective times (calibration).

`estimate` prices a ring collective over W ranks as `latency + (W - 1) * hop_latency + wire
bytes / bandwidth` (see its docstring), with one bandwidth inside a node and one between
nodes. A calibration file holds measured times of all-gathers and reduce-scatters (size, W,
whether the ranks spanned nodes), written by `tools/calibrate_links.py` on the machines to
plan for; `fit_links` finds the figures that explain them best (least squares per link kind),
and `load_links` reads a file into options for `estimate` / `advise` (`--links` on the
command line). Calibration JSON::

    {"backend": "gloo", "ranks_per_node": 8, "measurements": [
        {"collective": "all_gather", "world": 4, "bytes": 1048576, "seconds": 0.0012,
         "inter_node": false}, ...]}

`bytes` is one rank's shard (what it contributes); a ring moves (W - 1) of them per rank.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

_COLLECTIVES = ("all_gather", "reduce_scatter")
_KEYS = ("collective", "world", "bytes", "seconds", "inter_node")


@dataclass(frozen=True)
class Links:
    """The cost model's link figures (the `estimate` options of the same names).

    Attributes:
        intra_node_gbps: Per-rank bandwidth inside a node, GB/s.
        inter_node_gbps: Per-rank bandwidth between nodes, GB/s.
        latency_us: Fixed cost of one collective, microseconds.
        hop_latency_us: Cost of each ring step beyond its bytes, microseconds.
        ranks_per_node: Ranks per node where the figures were measured.
    """

    intra_node_gbps: float
    inter_node_gbps: float
    latency_us: float
    hop_latency_us: float
    ranks_per_node: int

    def options(self) -> dict[str, Any]:
        """The figures as `estimate` / `advise` keyword arguments.

        Example:
            >>> Links(100.0, 10.0, 5.0, 1.0, 8).options()["inter_node_gbps"]
            10.0
        """
        return {
            "intra_node_gbps": self.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps,
            "latency_us": self.latency_us,
            "hop_latency_us": self.hop_latency_us,
        }


def fit_links(
    measurements: Sequence[Mapping[str, Any]], *, ranks_per_node: int, default: Links
) -> Links:
    """The link figures that best explain measured collective times.

    Per link kind (inside a node, between nodes) a least-squares fit of
    `seconds = latency + (W - 1) * hop + (W - 1) * bytes / bandwidth` over the measurements of
    that kind; a kind without measurements (one machine has no "between nodes") keeps
    `default`'s figures. Latencies fitted below zero are clamped to zero (refitting the rest).
    Measurements at a single world size cannot tell the latencies from the bandwidth: only the
    bandwidth is fitted then, beside `default`'s latencies (the latencies come from the
    intra-node fit when that one has two world sizes).

    Args:
        measurements: Records with the keys of the module docstring.
        ranks_per_node: Ranks per node of the measuring machines.
        default: Figures for what was not measured.

    Returns:
        The fitted Links.

    Raises:
        ValueError: A record is malformed, or one kind's records cannot separate the three
            figures (fewer than three distinct (W, bytes) points, or a single W).

    Example:
        >>> rows = [{"collective": "all_gather", "world": w, "bytes": b, "inter_node": False,
        ...          "seconds": 10e-6 + (w - 1) * (2e-6 + b / 5e9)}
        ...         for w in (2, 4) for b in (1e6, 4e6)]
        >>> links = fit_links(rows, ranks_per_node=8, default=Links(400, 50, 20, 2, 8))
        >>> round(links.intra_node_gbps, 3), round(links.latency_us, 3)
        (5.0, 10.0)
    """
    rows = [_check_record(i, m) for i, m in enumerate(measurements)]
    figures = {"intra": default.intra_node_gbps, "inter": default.inter_node_gbps}
    latency, hop = default.latency_us, default.hop_latency_us
    for kind, inter in (("intra", False), ("inter", True)):
        mine = [r for r in rows if r[3] is inter]
        if not mine:
            continue
        points = {(w, b) for w, b, _, _ in mine}
        if len({w for w, _ in points}) == 1:  # only the bandwidth can be told apart
            base, step = latency * 1e-6, hop * 1e-6
            inverse = _bandwidth_alone(mine, base, step)
        elif len(points) < 3:
            raise ValueError(
                f"the {kind}-node measurements cannot separate latency, per-step latency and "
                f"bandwidth: measure 3 (world, bytes) points over 2 world sizes (or one world "
                f"size, for the bandwidth alone), got {sorted(points)}"
            )
        else:
            base, step, inverse = _least_squares(mine)
        most_bytes = max((w - 1) * b for w, b, _, _ in mine)
        if inverse * most_bytes <= 1e-6 * max(s for _, _, s, _ in mine):  # no byte term
            raise ValueError(
                f"the {kind}-node times do not grow with the bytes sent: no bandwidth fits"
            )
        figures[kind] = 1e-9 / inverse
        if not inter:  # the latencies come from inside a node when that was measured
            latency, hop = base * 1e6, step * 1e6
    return Links(figures["intra"], figures["inter"], latency, hop, ranks_per_node)


def _bandwidth_alone(rows: list[tuple[int, int, float, bool]], base: float, step: float) -> float:
    """Seconds per byte fitting `seconds - base - (W - 1) step` by least squares (through 0)."""
    sent = [(w - 1) * b for w, b, _, _ in rows]
    left = [s - base - (w - 1) * step for w, _, s, _ in rows]
    return max(0.0, sum(x * y for x, y in zip(sent, left, strict=True)) / sum(x * x for x in sent))


def _least_squares(rows: list[tuple[int, int, float, bool]]) -> tuple[float, float, float]:
    """(latency, hop, seconds per byte) minimizing the squared error, latencies >= 0."""
    columns = [(1.0, w - 1.0, (w - 1.0) * b) for w, b, _, _ in rows]
    seconds = [s for _, _, s, _ in rows]
    free = [0, 1, 2]
    while True:
        solution = _solve(columns, seconds, free)
        negative = [i for i in (0, 1) if i in free and solution[i] < 0]
        if not negative:
            return solution[0], solution[1], solution[2]
        free.remove(negative[0])  # clamp that latency to zero and fit the rest again


def _solve(columns: Sequence[tuple[float, ...]], y: list[float], free: list[int]) -> list[float]:
    """Normal equations over the `free` columns (the others are zero), by Gauss-Jordan."""
    n = len(free)
    # Scale each column so the normal matrix is well conditioned (bytes dwarf the rest).
    scale = [max(abs(c[j]) for c in columns) or 1.0 for j in free]
    a = [[sum(c[free[i]] * c[free[j]] for c in columns) / (scale[i] * scale[j]) for j in range(n)]
         + [sum(c[free[i]] * t for c, t in zip(columns, y, strict=True)) / scale[i]]
         for i in range(n)]  # fmt: skip
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("the measurements do not determine the link figures (singular)")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * p for x, p in zip(a[r], a[col], strict=True)]
    out = [0.0, 0.0, 0.0]
    for i, j in enumerate(free):
        out[j] = a[i][n] / a[i][i] / scale[i]
    return out


def _check_record(index: int, record: object) -> tuple[int, int, float, bool]:
    if not isinstance(record, Mapping) or sorted(record) != sorted(_KEYS):
        raise ValueError(
            f"measurement {index} must be an object with exactly the keys {', '.join(_KEYS)}; "
            f"got {record!r:.120}"
        )
    if record["collective"] not in _COLLECTIVES:
        raise ValueError(
            f"measurement {index}: collective must be one of {_COLLECTIVES}, got "
            f"{record['collective']!r}"
        )
    world, size, seconds = record["world"], record["bytes"], record["seconds"]
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"measurement {index}: world must be an int >= 2, got {world!r}")
    if not isinstance(size, int | float) or isinstance(size, bool) or not 0 < size < 2**62:
        raise ValueError(f"measurement {index}: bytes must be a number in (0, 2**62), got {size!r}")
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"measurement {index}: seconds must be a finite number > 0")
    if not isinstance(record["inter_node"], bool):
        raise ValueError(f"measurement {index}: inter_node must be true or false")
    return world, int(size), float(seconds), record["inter_node"]


def link_profile_names() -> tuple[str, ...]:
    """Calibrations shipped with the package, by name (`load_links` takes them).

    Example:
        >>> link_profile_names()
        ('h800-fsdp2',)
    """
    folder = resources.files("shard_planner") / "links"
    return tuple(sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json")))


def load_links(path: str | os.PathLike[str], *, default: Links | None = None) -> Links:
    """Reads a calibration file and fits its link figures (`fit_links`).

    Example:
        >>> links = load_links("h800-fsdp2")  # torch FSDP2 on 64 H800, as published
        >>> round(links.inter_node_gbps, 1), links.ranks_per_node
        (135.6, 8)

    Args:
        path: A JSON file as in the module docstring (`tools/calibrate_links.py` writes one),
            or the name of a shipped calibration (`link_profile_names`): "h800-fsdp2", what
            torch FSDP2's collectives achieved while training on 64 H800 GPUs (the
            veScale-FSDP paper's Table 1; its "source" says how it was measured).
        default: Figures for a link kind the file did not measure; by default `estimate`'s
            (400 GB/s in a node, 50 GB/s between nodes, 20 us, 2 us per step).

    Returns:
        The fitted Links; `Links.options()` passes them to `estimate` / `advise`.

    Raises:
        ValueError: The file cannot be read, is not JSON, or does not hold measurements that
            determine the figures (the message says which).
    """
    if str(path) in link_profile_names() and not pathlib.Path(path).exists():
        path = str(resources.files("shard_planner") / "links" / f"{path}.json")
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("measurements"), list):
        raise ValueError(f"{path}: expected an object with a 'measurements' list")
    ranks_per_node = doc.get("ranks_per_node", 8)
    if (
        isinstance(ranks_per_node, bool)
        or not isinstance(ranks_per_node, int)
        or ranks_per_node < 1
    ):
        raise ValueError(f"{path}: ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
    fallback = default or Links(400.0, 50.0, 20.0, 2.0, ranks_per_node)
    return fit_links(doc["measurements"], ranks_per_node=ranks_per_node, default=fallback)


def topology_line(ranks_per_node: int, options: Mapping[str, Any], fitted: str | None) -> str:
    """The links a plan is priced on, in words (what `estimate` / `advise` print first).

    Example:
        >>> print(topology_line(8, {"intra_node_gbps": 400.0, "inter_node_gbps": 50.0,
        ...                         "latency_us": 20.0, "hop_latency_us": 2.0, "rails": 8}, None))
        links: 8 ranks per node, 400 GB/s per rank inside it; between nodes 50 GB/s per NIC, a ring over up to 8 NICs per node (rails 8); 20 us per collective + 2 us per ring step
    """  # noqa: E501
    rails = options.get("rails", 1)
    between = (
        f"{options['inter_node_gbps']:.4g} GB/s per rank as fitted (NICs included)"
        if fitted
        else f"{options['inter_node_gbps']:.4g} GB/s per NIC, a ring over up to {rails} NICs per "
        f"node (rails {rails})" if rails > 1
        else f"{options['inter_node_gbps']:.4g} GB/s per rank, each ring through one NIC per "
        f"node (rails 1)"
    )  # fmt: skip
    source = f" (calibrated: {fitted})" if fitted else ""
    return (
        f"links{source}: {ranks_per_node} ranks per node, {options['intra_node_gbps']:.4g} GB/s "
        f"per rank inside it; between nodes {between}; {options['latency_us']:.4g} us per "
        f"collective + {options['hop_latency_us']:.4g} us per ring step"
    )
