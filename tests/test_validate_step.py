"""tools/validate_step.py calibrates the planner on this machine and sets its step beside ours."""

import json
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).parent.parent / "tools" / "validate_step.py"


def test_validation_tool_predicts_each_measured_step(tmp_path) -> None:
    out = tmp_path / "validate.json"
    result = subprocess.run(
        [sys.executable, str(TOOL), "--worlds", "2,3", "--steps", "2", "--repeats", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FutureWarning" not in result.stderr, result.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    # (The link fit needs two world sizes: latency, per-step latency and bandwidth.)
    assert [(r["model"], r["world"]) for r in rows] == [
        ("dense", 2), ("moe", 2), ("dense", 3), ("moe", 3)]  # fmt: skip
    for row in rows:
        # Measured: compute alone and the engine's step; calibrated: overlap 0..1.
        assert row["compute_s"] > 0 and row["step_s"] > 0
        assert 0.0 <= row["overlap"] <= 1.0
        # Predicted: at least the compute it was calibrated on, plus communication, the
        # update and the host work (one rank's step beyond compute and update), at most all
        # of them one after the other.
        assert row["compute_s"] < row["predicted_s"] and row["host_s"] >= 0
        serial = row["compute_s"] + row["comm_s"] + row["update_s"] + row["host_s"]
        assert row["predicted_s"] <= serial + 1e-9
        assert row["error"] == row["predicted_s"] / row["step_s"] - 1
        # The model's error: within 25% at 12 steps (docs/shard-planner.md's table); two
        # steps of one repeat on a shared 2-core machine are noisier, so the bound here is
        # 50% (this machine: -4% .. +2%). A missing term (communication, the update or the
        # host work) moved it by 15-40% when it was built.
        assert abs(row["error"]) <= 0.5, row
    # The moe model holds more parameters than the dense one: more to communicate.
    assert rows[1]["comm_s"] > rows[0]["comm_s"]
    assert doc["links"]["intra_node_gbps"] > 0
    assert "| dense | 2 |" in result.stdout and "| moe | 2 |" in result.stdout
