import importlib.metadata

import ragged_optimizers


def test_version_matches_distribution_metadata() -> None:
    assert ragged_optimizers.__version__ == importlib.metadata.version("ragged-optimizers")
