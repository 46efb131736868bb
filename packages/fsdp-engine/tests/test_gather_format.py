"""fp8 parameter gathers on 1-4 gloo ranks: exact against one process, half the bytes of bf16."""

import engine_gather_format_cases as cases
import pytest


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_float8_gathers_train_as_one_process_with_quantized_weights(pools, world) -> None:
    pools[world].run(cases.check_float8_gather_training)


def test_float8_gathers_under_hsdp(pools) -> None:
    pools[4].run(cases.check_float8_gather_training, 2, True)


def test_float8_gathers_of_tensor_parallel_pieces(pools) -> None:
    pools[4].run(cases.check_float8_gather_with_tensor_parallel)


@pytest.mark.parametrize("world", [1, 2, 3])  # 4: its shards would pad a block (see the case)
def test_float8_gathers_move_half_the_bytes(pools, world) -> None:
    for result in pools[world].run(cases.check_float8_gather_bytes):
        print(f"W={world}: gathered bytes {result}")


def test_gather_format_bad_input(pools) -> None:
    pools[2].run(cases.check_gather_format_bad_input)
