import importlib.metadata

import ragged_placement


def test_version_matches_distribution_metadata() -> None:
    assert ragged_placement.__version__ == importlib.metadata.version("ragged-placement")
