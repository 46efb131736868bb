"""Importing ragged_placement must not change any DTensor result that uses no RaggedShard."""

import pathlib
import subprocess
import sys

import torch

SCRIPT = pathlib.Path(__file__).with_name("unchanged_script.py")


def test_fsdp2_and_redistributes_are_bit_identical_with_and_without_the_import(tmp_path) -> None:
    outputs = {}
    for mode in ("with", "without"):
        out = tmp_path / f"{mode}.pt"
        subprocess.run([sys.executable, str(SCRIPT), mode, str(out)], check=True, timeout=300)
        outputs[mode] = torch.load(out)
    assert outputs["with"].keys() == outputs["without"].keys()
    assert len(outputs["with"]) > 10
    for key, value in outputs["with"].items():
        assert torch.equal(value, outputs["without"][key]), key
