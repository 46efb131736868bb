"""Uneven tensor-parallel splits under fully_shard, against one process, across meshes, FSDP2."""

import pytest
import torch
import uneven_tp_cases as cases

_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize(("world", "shape"), [(4, (2, 2)), (4, (1, 4)), (3, (1, 3)), (2, (1, 2))])
def test_uneven_tp_trains_as_one_process(pools, world, shape) -> None:
    # Odd dims (27 hidden, 9 model): at tp 2, 14 / 13 rows and columns; at tp 4, 7,7,7,6.
    (result, *_) = pools[world].run(cases.check_uneven_tp_training, shape)
    assert result["uneven"] or shape[1] == 3, result  # 27 splits evenly over 3


@pytest.mark.parametrize(
    ("saver", "loader"), [("ours", "ours"), ("ours", "fsdp2"), ("fsdp2", "ours")]
)
def test_uneven_tp_checkpoint_reshards_and_interoperates(pools, tmp_path, saver, loader) -> None:
    # Saved at (dp 2, tp 2), loaded at (1, 4) bit for bit; and between ours and FSDP2 at (2, 2).
    pools[4].run(cases.check_uneven_tp_save, str(tmp_path), (2, 2), saver)
    pools[4].run(cases.check_uneven_tp_load, str(tmp_path), (2, 2), loader)
    if loader == "ours":
        pools[4].run(cases.check_uneven_tp_load, str(tmp_path), (1, 4), loader)


def test_uneven_offloaded_state_dicts_round_trip(pools) -> None:
    pools[4].run(cases.check_state_dict_round_trip)
