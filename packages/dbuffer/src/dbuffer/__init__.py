"""dbuffer: a group of tensors in one planned buffer, with zero-copy collectives.

Example (`mesh`: a 1-D DeviceMesh; `w`, `b`: tensors):
    >>> from dbuffer import DBuffer
    >>> buf = DBuffer([("w", w), ("b", b)], mesh, block_rows={"w": 32})
    >>> buf.unshard().wait()
    >>> torch.equal(buf.full("w"), w)
    True
"""

from dbuffer._buffer import DBuffer
from dbuffer._handle import Handle
from dbuffer._host_shard import HostShard
from dbuffer._outer import splits_unevenly
from dbuffer._wire import BlockFloat8

__version__ = "0.1.0"

__all__ = ["BlockFloat8", "DBuffer", "Handle", "HostShard", "__version__", "splits_unevenly"]
