import importlib.metadata

import dbuffer


def test_version_matches_distribution_metadata() -> None:
    assert dbuffer.__version__ == importlib.metadata.version("dbuffer")
