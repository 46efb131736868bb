"""What dbuffer's debug guard against reading freed memory costs in a training step.

Run: `nox -s bench -- guard` (or `python benchmarks/bench_guard.py`).

By default the unsharded parameters are plain tensors. With `DBUFFER_CHECK_FREED=1` they are
guarded: every op that takes one goes through the guard's `__torch_function__` (one storage
check) and the aliases autograd saves for backward are checked when unpacked. This counts
both per step of the dense example decoder (one gloo rank) and times the step of two copies
of the model, one built with the guard and one without, alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    from fsdp_engine import fully_shard

    cfg = Config(vocab=256, dim=512, num_heads=8, num_layers=8, hidden=1376)
    mesh = init_device_mesh("cpu", (1,))
    tokens = torch.randint(0, cfg.vocab, (4, 128))

    def build(guarded: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = Decoder(cfg)
        os.environ["DBUFFER_CHECK_FREED"] = "1" if guarded else "0"
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    engines = {"on": build(True), "off": build(False)}
    os.environ.pop("DBUFFER_CHECK_FREED")

    def step(setting: str) -> None:
        model, opt = engines[setting]
        loss_fn(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    for setting in engines:
        step(setting)
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
    step("on")
    views.BufferView.__torch_function__ = guarded  # type: ignore[method-assign]
    views._unpack = original_unpack

    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for setting in ("on", "off"):
            for _ in range(args.steps):
                start = time.perf_counter()
                step(setting)
                times[setting].append(time.perf_counter() - start)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    num_params = sum(p.numel() for p in engines["on"][0].parameters())
    print(f"dense decoder {num_params / 1e6:.1f}M ({cfg}), batch 4 x 128, one gloo rank")
    print(
        f"per step with the guard: {counts['ops']} guarded ops, {counts['unpacks']} saved "
        "aliases checked"
    )
    print(
        f"median step: {on * 1e3:.1f} ms guarded (DBUFFER_CHECK_FREED=1), {off * 1e3:.1f} ms "
        f"by default ({100 * (on - off) / off:+.2f}%)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
