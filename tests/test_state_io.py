"""The state users save, copy, export and edit around training (fully_shard, 1-3 gloo ranks)."""

import pytest
import state_io_cases as cases

OPTIMIZERS = ["flat-adamw", "adamw", "sgd", "adamw8bit", "muon"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_state_dicts_save_pickle_deepcopy_and_load_back(pools, world) -> None:
    for optimizer in OPTIMIZERS:
        sizes = pools[world].run(cases.check_round_trips, optimizer)[0]
        # torch.save holds each rank's pieces once, not the whole flat shard per tensor.
        assert sizes["saved_bytes"] < 2 * sizes["piece_bytes"] + 200_000, (optimizer, sizes)


@pytest.mark.parametrize("world", [2, 3])
def test_full_optimizer_state_dict_equals_torch_adamw(pools, world) -> None:
    entries = pools[world].run(cases.check_full_state_equals_torch_adamw)[0]
    assert entries == 17, entries  # every parameter's state, gathered to rank 0


@pytest.mark.parametrize("optimizer", ["flat-adamw", "adamw8bit", "muon"])
def test_full_state_dicts_load_back_at_another_world_size(pools, tmp_path, optimizer) -> None:
    path = str(tmp_path / "full.pt")
    pools[2].run(cases.check_full_state_save, optimizer, path)
    assert pools[3].run(cases.check_full_state_load, optimizer, path)[0] == 17


@pytest.mark.parametrize("edit", list(cases.EDITS))
def test_state_edits_are_followed_as_torch_adamw(pools, edit) -> None:
    pools[2].run(cases.check_edits_follow_torch_adamw, edit)


def test_adamw8bit_state_edits(pools) -> None:
    pools[3].run(cases.check_adamw8bit_edits)
