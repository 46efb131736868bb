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


@pytest.mark.parametrize("world", [1, 3])
def test_optimizers_step_offloaded_parameters(pools, world) -> None:
    # CPUOffloadPolicy: the optimizers step the host shards (and read the host gradients).
    for optimizer in ("adamw8bit", "muon"):
        pools[world].run(cases.check_engine_training, optimizer, True)


@pytest.mark.parametrize("world", [1, 3])
def test_optimizer_state_offload_steps_unchanged(pools, world) -> None:
    # fsdp_engine.OptimizerStateOffload with torch's AdamW and the flat AdamW (its views of
    # the state are read again after each move).
    for optimizer in ("torch", "flat"):
        pools[world].run(cases.check_optimizer_state_offload, optimizer)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_flat_adamw_equals_torch_adamw_on_the_engine(pools, world) -> None:
    for kind, precision in [("dense", "fp32"), ("moe", "bf16"), ("moe", "fp32")]:
        result = pools[world].run(cases.check_flat_adamw_on_engine, kind, precision)[0]
        gap = max(abs(a - b) for a, b in zip(result["losses"], result["one_process"], strict=True))
        print(
            f"W={world} {kind} {precision}: {result['params']} parameters in {result['runs']} "
            f"runs, max loss gap to one process {gap:.1e}"
        )


@pytest.mark.parametrize(("saver", "loaders"), [("ours", ("ours", "fsdp2")), ("fsdp2", ("ours",))])
def test_flat_adamw_checkpoint_loads_at_another_world_size_and_engine(
    pools, tmp_path, saver, loaders
) -> None:
    """Saved at 4 ranks, loaded at 3: ours into ours and into FSDP2 + torch's AdamW, and
    FSDP2's into ours; training goes on as in one process."""
    pools[4].run(cases.check_adamw_checkpoint, str(tmp_path), saver, "save")
    for loader in loaders:
        result = pools[3].run(cases.check_adamw_checkpoint, str(tmp_path), loader, "load")[0]
        gap = max(abs(a - b) for a, b in zip(result["losses"], result["one_process"], strict=True))
        print(f"saved by {saver} at W=4, loaded by {loader} at W=3: loss gap {gap:.1e}")


@pytest.mark.parametrize("ns_batch_numel", [2**22, 1], ids=["batched", "one-per-batch"])
def test_muon_under_hsdp_orthogonalizes_each_matrix_once_in_the_mesh(pools, ns_batch_numel):
    """fully_shard over 8 Linear(256, 256) on HSDP (2, 2), Muon's defaults: the busiest rank
    does a quarter of the unique Newton-Schulz work, not half (every replica) or all (one
    batch of 8 on one owner, as the batching was before owners were balanced)."""
    from ragged_optimizers import ns_flops

    unique = 8 * ns_flops((256, 256), 5)
    once = pools[4].run(cases.check_muon_hsdp_on_engine, ns_batch_numel, "auto")
    per_replica = pools[4].run(cases.check_muon_hsdp_on_engine, ns_batch_numel, False)
    print(f"busiest rank: {max(once) / unique:.3f} of the unique work (per replica: "
          f"{max(per_replica) / unique:.3f})")  # fmt: skip
    assert max(once) / unique <= 0.30 and sum(once) == unique, once
    assert max(per_replica) / unique == 0.5 and sum(per_replica) == 2 * unique, per_replica
