"""What dbuffer's freed-memory guard costs in a training step of the engine (one gloo rank).

Run: `nox -s bench -- guard` (or `python benchmarks/bench_guard.py`).

Every op that takes an unsharded parameter goes through the guard's `__torch_function__`
(one storage check), and the aliases autograd saves for backward are checked when unpacked.
This counts both per step of the dense example decoder and times the step with the guard on
and off (the same model; off = torch's plain dispatch for the views), alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    from model import Config, Decoder, loss_fn
    from torch.distributed.device_mesh import init_device_mesh

    import dbuffer._views as views
    import ragged_placement  # noqa: F401
    from fsdp_engine import fully_shard

    torch.manual_seed(0)
    cfg = Config(vocab=256, dim=512, num_heads=8, num_layers=8, hidden=1376)
    model = Decoder(cfg)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab, (4, 128))

    def step() -> None:
        loss_fn(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    step()
    guarded = views.BufferView.__torch_function__
    counts = {"ops": 0, "unpacks": 0}
    original_unpack = views._unpack

    def counting(cls: type, *args: object, **kwargs: object) -> object:
        counts["ops"] += 1
        return guarded.__func__(cls, *args, **kwargs)  # type: ignore[attr-defined]

    def counting_unpack(saved: object) -> torch.Tensor:
        counts["unpacks"] += isinstance(saved, views._Saved)
        return original_unpack(saved)

    views.BufferView.__torch_function__ = classmethod(counting)  # type: ignore[assignment]
    views._unpack = counting_unpack
    step()
    views.BufferView.__torch_function__ = guarded  # type: ignore[method-assign]
    views._unpack = original_unpack

    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for setting in ("on", "off"):
            views.BufferView.__torch_function__ = (  # type: ignore[method-assign]
                guarded if setting == "on" else torch._C._disabled_torch_function_impl
            )
            step()
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times[setting].append(time.perf_counter() - start)
    views.BufferView.__torch_function__ = guarded  # type: ignore[method-assign]
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    num_params = sum(p.numel() for p in model.parameters())
    print(f"dense decoder {num_params / 1e6:.1f}M ({cfg}), batch 4 x 128, one gloo rank")
    print(f"per step: {counts['ops']} guarded ops, {counts['unpacks']} saved aliases checked")
    print(
        f"median step: {on * 1e3:.1f} ms guarded, {off * 1e3:.1f} ms unguarded "
        f"({100 * (on - off) / off:+.2f}%)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
