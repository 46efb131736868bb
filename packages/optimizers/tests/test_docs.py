"""The README's first example (alone and under torchrun) and every docstring example run."""

import pathlib

from doctest_support import docs_tests

README = pathlib.Path(__file__).parent.parent / "README.md"

test_docstring_examples_run, test_readme_example_runs = docs_tests(README, "optimizer_cases", 15)


def test_readme_example_prints_what_its_comment_says(tmp_path) -> None:
    from doctest_support import run_readme_example

    assert "torch.uint8" in run_readme_example(README, tmp_path, 1)  # 8-bit codes, one rank
