"""examples/train.py's rank work on the ranks of a RankPool (no spawn per run).

`python examples/train.py --nproc N` checks its input, spawns N ranks, and each calls
`train.run(args)`. Here the pool's ranks, already in one process group, call the same
`train.run` with the same arguments: the run's record is the file rank 0 writes, as from the
command line. Spawning and importing torch for every run would cost the suite more than
training these small models does.
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def train_on_ranks(argv: list[str]) -> None:
    """Parses and checks `argv` as train.py does, then runs it on this rank of the group."""
    import train

    args = train.parse_args(argv)
    train.check_args(args, dist.get_world_size())
    train.run(args)
    # As train.py does before its ranks leave: nothing of this run (hooks, meshes) outlives it.
    gc.collect()
    dist.barrier()
