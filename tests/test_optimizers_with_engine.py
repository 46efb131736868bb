"""ragged_optimizers on fully_shard(block_rows=32) models, 2-4 gloo ranks."""

import engine_optimizer_cases as cases
import pytest


@pytest.mark.parametrize("world", [2, 3, 4])
def test_optimizers_on_engine_parameters_match_one_process(pools, world) -> None:
    for optimizer in ("adamw8bit", "muon"):
        result = pools[world].run(cases.check_engine_training, optimizer)[0]
        gap = max(abs(a - b) for a, b in zip(result["losses"], result["one_process"], strict=True))
        print(
            f"W={world} {optimizer}: loss {result['losses'][0]:.3f} -> "
            f"{result['losses'][-1]:.3f}, max gap to one process {gap:.1e}"
        )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_flat_adamw_equals_torch_adamw_on_the_engine(pools, world) -> None:
    for kind, precision in [("dense", "fp32"), ("moe", "bf16"), ("moe", "fp32")]:
        result = pools[world].run(cases.check_flat_adamw_on_engine, kind, precision)[0]
        gap = max(abs(a - b) for a, b in zip(result["losses"], result["one_process"], strict=True))
        print(
            f"W={world} {kind} {precision}: {result['params']} parameters in {result['runs']} "
            f"runs, max loss gap to one process {gap:.1e}"
        )
