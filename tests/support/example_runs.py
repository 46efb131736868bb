"""examples/train.py's rank work on the ranks of a RankPool (no spawn per run).

`python examples/train.py --nproc N` checks its input, spawns N ranks, and each calls
`train.run(args)`. Here the pool's ranks, already in one process group, call the same
`train.run` with the same arguments: the run's record is the file rank 0 writes, as from the
command line. Spawning and importing torch for every run would cost the suite more than
training these small models does.
"""

from __future__ import annotations

import torch.distributed as dist


def train_on_ranks(argv: list[str]) -> None:
    """Parses and checks `argv` as train.py's `main` does, then runs it on this rank."""
    import train

    args = train.parse_args(argv)
    train.check_args(args, dist.get_world_size())
    train.run(args)  # frees the run's model and waits for every rank before it returns
