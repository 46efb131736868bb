"""RaggedShard state dicts on 1-4 gloo ranks: full loads, DCP across world sizes, with TP."""

import pytest
import ragged_checkpoint_cases as cases
from ragged_support import UNITS, WORLD_SIZES


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_load_full_state_dict(pools, world) -> None:
    for units in UNITS[world]:
        for broadcast in (False, True):
            pools[world].run(cases.check_load_full_state_dict, broadcast, units)


def test_checkpoint_save_on_4_load_on_2_3_4(pools, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    results = pools[4].run(cases.check_dcp_save, path, (1, 0, 4, 7))
    total = sum(r["data_bytes"] for r in results)
    for r in results:
        # Only plans and metadata cross ranks (tens of KB), never the tensor data (1.5 MB).
        assert r["collective_bytes"] < 0.05 * total, (r, total)
    pools[4].run(cases.check_dcp_load, path, "ragged", (3, 1, 1, 1))
    for world, units in ((2, (1, 2)), (3, (0, 1, 1))):
        for kind in ("ragged", "shard0", "replicate"):
            pools[world].run(cases.check_dcp_load, path, kind, units)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_composition_with_shard_on_the_other_axis(pools, layout, tmp_path) -> None:
    for i, units in enumerate([(1, 1), (3, 1), (0, 2)]):
        pools[4].run(cases.check_with_tensor_parallel, layout, units, str(tmp_path / f"ckpt{i}"))


def test_strided_ragged_shard(pools, tmp_path) -> None:
    for i, units in enumerate([(1, 1), (3, 1), (0, 2)]):
        pools[4].run(cases.check_strided, units, str(tmp_path / f"ckpt{i}"))
