"""The README's first example (alone and under torchrun) and every docstring example run."""

import pathlib

import pytest
from doctest_support import run_readme_example

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_docstring_examples_run(pools) -> None:
    import ragged_cases as cases

    (result,) = pools[1].run(cases.check_doctests)
    assert result["failed"] == 0, result["report"]
    assert result["attempted"] >= 8, result


@pytest.mark.parametrize("nproc", [1, 3])
def test_readme_example_runs(tmp_path, nproc) -> None:
    run_readme_example(README, tmp_path, nproc)
