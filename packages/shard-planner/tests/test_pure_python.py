import subprocess
import sys


def test_import_does_not_pull_in_torch() -> None:
    # In a fresh interpreter: other tests of the session may have imported torch already.
    code = (
        "import sys, shard_planner; "
        "shard_planner.plan_layout([shard_planner.TensorSpec('a', 10)], 2); "
        "assert 'torch' not in sys.modules, 'shard_planner imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
