"""fully_shard on Hugging Face transformers models (built from configs) on 1-3 gloo ranks.

transformers is a test dependency (nox installs it); a machine without it (the GPU machine,
which has no package index) skips this module.
"""

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import hf_cases as cases


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_loss_trains_as_one_process_and_fsdp2(pools, world, arch) -> None:
    pools[world].run(cases.check_training, arch, False)


def test_gradient_checkpointing(pools) -> None:
    pools[2].run(cases.check_training, "llama", True)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_generate_with_uneven_eos_across_ranks(pools, world) -> None:
    pools[world].run(cases.check_generate_with_uneven_eos)


@pytest.mark.parametrize("world", [1, 2])
def test_save_pretrained_and_broadcast_load(pools, world, tmp_path) -> None:
    pools[world].run(cases.check_state_dicts, str(tmp_path / "llama"))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_meta_init_with_the_models_own_init(pools, world, arch) -> None:
    pools[world].run(cases.check_meta_init, arch)


EXAMPLE = pathlib.Path(__file__).parents[3] / "examples" / "hf_finetune.py"


@pytest.mark.parametrize("world", [1, 2])
def test_hf_finetune_example_runs(world) -> None:
    """The README's transformers example, alone and under torchrun: the loss goes down and
    every rank generates."""
    if world == 1:
        command = [sys.executable, str(EXAMPLE)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={world}", str(EXAMPLE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0], result.stdout
    assert len(re.findall(r"generated \[", result.stdout)) == world, result.stdout
