"""Runs FSDP2 training and Shard/Replicate redistributes on 2 gloo ranks; prints the numbers.

`python unchanged_script.py {with,without} OUT.pt`: with or without `import ragged_placement`.
test_unchanged.py runs it both ways and requires identical results.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, init_file: str, use_ragged: bool, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if use_ragged:
        import ragged_placement  # noqa: F401
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    results: dict[str, torch.Tensor] = {}
    full = torch.randn(7, 5)
    for name, placements in {"s0": [Shard(0)], "s1": [Shard(1)], "r": [Replicate()]}.items():
        dt = distribute_tensor(full, mesh, placements)
        for target in ([Shard(0)], [Shard(1)], [Replicate()]):
            moved = dt.redistribute(mesh, target)
            results[f"{name}->{target[0]}"] = moved.full_tensor()
        results[f"{name}.sum"] = (dt * 2).sum().full_tensor()

    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 2 + rank))
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        results[f"loss{step}"] = loss.detach()
    for name, p in model.named_parameters():
        results[name] = p.full_tensor()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: after FSDP2 on gloo it intermittently aborts ("terminate called
    # without an active exception") once all work is done, which would fail the run spuriously.
    os._exit(0)


def main() -> None:
    use_ragged, out = sys.argv[1] == "with", sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(os.path.join(tmp, "rdzv"), use_ragged, out), nprocs=2, start_method="spawn"
        )


if __name__ == "__main__":
    main()
