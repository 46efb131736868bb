"""Rank work for the rank pool's own test (importable in spawned ranks)."""

import os

import torch.distributed as dist


def abort_on_rank(rank: int) -> int:
    """Aborts the process on `rank` (as a native heap check would); returns the rank elsewhere."""
    me = dist.get_rank()
    if me == rank:
        os.abort()
    return me
