"""Tensor-subclass parameters (torchao NF4 QLoRA) on 1-4 gloo ranks: one process, FSDP2."""

import pytest

pytest.importorskip("torchao", reason="torchao (NF4Tensor) is not installed for this torch")

import engine_subclass_cases as cases


@pytest.mark.parametrize("world", [1, 2, 4])  # 3: NF4's blocks do not split in 3 (bad input)
def test_nf4_qlora_trains_as_one_process_and_fsdp2(pools, world) -> None:
    pools[world].run(cases.check_nf4_qlora_training)


def test_nf4_qlora_under_hsdp_and_partial_reshard(pools) -> None:
    pools[4].run(cases.check_nf4_qlora_training, True)
    pools[4].run(cases.check_nf4_qlora_training, False, 2)


def test_nf4_checkpoint_round_trip_and_fsdp2_interop(pools, tmp_path) -> None:
    pools[2].run(cases.check_nf4_checkpoint, str(tmp_path))


@pytest.mark.parametrize("world", [2, 4])
def test_nf4_gathers_move_the_formats_bytes(pools, world) -> None:
    for result in pools[world].run(cases.check_nf4_gather_bytes):
        print(f"W={world}: gathered bytes {result}")


@pytest.mark.parametrize("world", [2, 3])
def test_nf4_bad_input(pools, world) -> None:
    pools[world].run(cases.check_nf4_bad_input)
