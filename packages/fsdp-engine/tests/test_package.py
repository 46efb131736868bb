import importlib.metadata

import fsdp_engine


def test_version_matches_distribution_metadata() -> None:
    assert fsdp_engine.__version__ == importlib.metadata.version("fsdp-engine")
