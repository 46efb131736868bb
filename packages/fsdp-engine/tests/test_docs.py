"""The README's first example (alone and under torchrun), its saving-and-loading guide and
every docstring example run."""

import pathlib

import pytest
from doctest_support import docs_tests, run_readme_example

README = pathlib.Path(__file__).parent.parent / "README.md"

test_docstring_examples_run, test_readme_example_runs = docs_tests(README, "engine_cases", 15)


@pytest.mark.parametrize("nproc", [2, 3])
def test_saving_and_loading_guide_runs(tmp_path, nproc) -> None:
    run_readme_example(README, tmp_path, nproc, section="Saving and loading")
    assert (tmp_path / "ckpt" / "step-1" / ".metadata").is_file()
    assert (tmp_path / "full.pt").is_file()
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == [
        f"rank{r}.pt" for r in range(nproc)
    ]
