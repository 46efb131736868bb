"""Checkpoints (DCP across world sizes and with FSDP2), meta-device init, full state loads."""

import engine_checkpoint_cases as cases
import pytest


@pytest.mark.parametrize(
    ("saver", "loader"), [("ours", "ours"), ("fsdp2", "ours"), ("ours", "fsdp2")]
)
def test_checkpoint_reshards_and_interoperates_with_fsdp2(pools, tmp_path, saver, loader) -> None:
    # Saved at W=4, loaded bit-exactly (model and AdamW state) at 4, 2 and 3.
    pools[4].run(cases.check_checkpoint_save, str(tmp_path), saver)
    # Resuming is bit-exact with the same engine (the same reductions in the same order).
    pools[4].run(cases.check_checkpoint_load, str(tmp_path), loader, saver == loader)
    for world in (2, 3):
        pools[world].run(cases.check_checkpoint_load, str(tmp_path), loader, False)


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        ("ours+offload", "fsdp2+offload"),
        ("fsdp2+offload", "ours+offload"),
        ("ours+offload", "ours"),
    ],
)
def test_offloaded_checkpoints_interoperate_with_fsdp2(pools, tmp_path, saver, loader) -> None:
    # CPUOffloadPolicy on either side: saved at W=3, loaded bit-exactly at 3 and 2; resumed
    # bit-exactly with the same engine and world (offloaded or not: the same arithmetic).
    pools[3].run(cases.check_checkpoint_save, str(tmp_path), saver)
    resume = saver.partition("+")[0] == loader.partition("+")[0]
    pools[3].run(cases.check_checkpoint_load, str(tmp_path), loader, resume)
    pools[2].run(cases.check_checkpoint_load, str(tmp_path), loader, False)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_meta_device_init_equals_one_process_and_allocates_one_shard(pools, world) -> None:
    for offload in (False, True):  # CPUOffloadPolicy: materialized into host shards
        for r in pools[world].run(cases.check_meta_init, offload):
            peak, shard, model = r["peak"], r["shard_bytes"], r["model_bytes"]
            print(
                f"world {world} offload {offload}: peak {peak} B, shard {shard} B, model {model} B"
            )


@pytest.mark.parametrize("world", [1, 3])
def test_load_full_state_dict_from_rank0(pools, world) -> None:
    pools[world].run(cases.check_load_full_state_dict)
