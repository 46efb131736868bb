"""RaggedShard: a DTensor placement for uneven, block-granular shards.

This package is an importable skeleton: its API arrives with the issue that builds it
(issue 3). It exports nothing but its version until then, so that nothing downstream can
depend on a placeholder.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
