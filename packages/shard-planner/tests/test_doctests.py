"""Every docstring example of the package runs, and so does the README's first example."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import shard_planner

MODULES = sorted(
    ["shard_planner"]
    + [f"shard_planner.{m.name}" for m in pkgutil.iter_modules(shard_planner.__path__)]
)
README = pathlib.Path(__file__).parent.parent / "README.md"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_docstring_examples_exist() -> None:
    attempted = sum(
        doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS).attempted
        for name in MODULES
    )
    assert attempted >= 20, attempted


def test_readme_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "the README has no python example"
    exec(compile(blocks[0], str(README), "exec"), {})
