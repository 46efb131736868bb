"""Ranks sharing one inductor cache run their own compiled code (see compile_cache_cases).

Every step runs first with a cache folder per rank (the reference), then in fresh ranks with
one folder for all, `COMPILE_CACHE_RUNS` times (default 2): the first shared run fills it
(ranks racing to write it), the next ones find every entry there. Each must give the
reference's tensors exactly. torchao's AdamW8bit runs where torchao is installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import compile_cache_cases as cases
import pytest
import torch
from rank_pool import RankPool

WORLD = 3


def _fresh_run(steps: list[str], cache: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    pool = RankPool(WORLD)
    try:
        return pool.run(cases.compiled_steps, steps, cache)
    finally:
        if not pool.broken:
            pool.close()


@pytest.mark.skipif(shutil.which("cc") is None, reason="inductor needs a C++ compiler")
def test_ranks_sharing_one_cache_run_their_own_shapes(tmp_path) -> None:
    steps = ["function", "adamw8bit"]
    if importlib.util.find_spec("torchao") is not None:
        steps.append("torchao")
    reference = _fresh_run(steps, str(tmp_path / "own" / "rank{rank}"))
    for attempt in range(int(os.environ.get("COMPILE_CACHE_RUNS", "2"))):
        shared = _fresh_run(steps, str(tmp_path / "shared"))
        for rank, (mine, theirs) in enumerate(zip(shared, reference, strict=True)):
            for step in steps:
                where = (attempt, rank, step)
                assert mine[step].keys() == theirs[step].keys(), where
                for name, value in mine[step].items():
                    assert value.shape == theirs[step][name].shape, (*where, name)
                    assert torch.equal(value, theirs[step][name]), (*where, name)
    print(f"{len(steps)} compiled steps ({', '.join(steps)}) on {WORLD} ranks: shared cache ok")
