import importlib.metadata

import ragged_optimizers


def test_version_matches_distribution_metadata() -> None:
    assert ragged_optimizers.__version__ == importlib.metadata.version("ragged-optimizers")


def test_compat_picks_this_torchs_collective_name() -> None:
    import torch
    import torch.distributed as dist

    from ragged_optimizers import _compat

    # 2.13 renamed all_gather_into_tensor (the old name warns there); 2.10-2.12 have only it.
    expected = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    assert _compat.all_gather_single is expected
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13):
        assert _compat.all_gather_single is not dist.all_gather_into_tensor
