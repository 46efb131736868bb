"""Distributed Muon and block-wise 8-bit AdamW on RaggedShard parameters.

This package is an importable skeleton: its API arrives with the issue that builds it
(a later issue). It exports nothing but its version until then, so that nothing downstream can
depend on a placeholder.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
