"""dbuffer: a group of tensors in one planned buffer, with zero-copy collectives.

Example:
    >>> from dbuffer import DBuffer
    >>> buf = DBuffer([("w", w), ("b", b)], mesh, block_rows={"w": 32})  # doctest: +SKIP
    >>> buf.unshard().wait()  # doctest: +SKIP
    >>> buf.full("w").shape == w.shape  # doctest: +SKIP
    True
"""

from dbuffer._buffer import DBuffer
from dbuffer._handle import Handle

__version__ = "0.1.0"

__all__ = ["DBuffer", "Handle", "__version__"]
