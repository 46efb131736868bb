"""tools/calibrate_links.py measures gloo collectives and writes a file the planner fits."""

import json
import pathlib
import subprocess
import sys

from shard_planner import estimate, load_links, load_preset

TOOL = pathlib.Path(__file__).parent.parent / "tools" / "calibrate_links.py"


def test_calibration_tool_writes_a_file_the_planner_reads(tmp_path) -> None:
    out = tmp_path / "links.json"
    # Sizes far apart: the byte term must dominate the fit even on a busy machine.
    result = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(out), "--worlds", "2,3",
         "--sizes-kib", "64,4096", "--repeats", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["measurements"]
    assert doc["backend"] == "gloo" and doc["ranks_per_node"] == 3
    # Both collectives, both world sizes, both sizes, each timed (the slowest rank's median).
    assert {(r["collective"], r["world"], r["bytes"]) for r in rows} == {
        (c, w, k * 1024)
        for c in ("all_gather", "reduce_scatter")
        for w in (2, 3)
        for k in (64, 4096)
    }
    assert all(r["seconds"] > 0 and r["inter_node"] is False for r in rows)
    links = load_links(out)
    assert 0 < links.intra_node_gbps < 1000 and links.inter_node_gbps == 50.0
    assert "fitted inside a node:" in result.stdout
    est = estimate(load_preset("llama3-8b").groups, shard_size=3, ranks_per_node=3,
                   **links.options())  # fmt: skip
    assert est.comm_time_s > 0
