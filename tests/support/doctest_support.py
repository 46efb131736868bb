"""Running a package's docstring examples and its README's first example, as users run them.

Docstring examples run inside a rank of a RankPool (a process group exists), each with fresh
objects from `make_globs()`, so one example's changes never leak into the next. The README
example runs in a fresh interpreter, alone (one rank) and under torchrun.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pathlib
import pkgutil
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def run_doctests(package: str, make_globs: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs every docstring example of `package`'s modules; returns counts and the report."""
    root = importlib.import_module(package)
    modules = [root] + [
        importlib.import_module(f"{package}.{info.name}")
        for info in pkgutil.iter_modules(root.__path__)
    ]
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for module in modules:
        for test in doctest.DocTestFinder().find(module, module.__name__):
            if test.examples:
                test.globs.update(make_globs())
                runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    return {"failed": result.failed, "attempted": result.attempted, "report": report.getvalue()}


def readme_example(readme: pathlib.Path) -> str:
    """The first ```python block of a README."""
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.DOTALL)
    if not blocks:
        raise AssertionError(f"{readme} has no python example")
    return str(blocks[0])


def readme_section(readme: pathlib.Path, title: str) -> str:
    """Every ```python block of a README's section `## title`, in order, as one script."""
    text = readme.read_text()
    start = text.find(f"\n## {title}\n")
    if start < 0:
        raise AssertionError(f"{readme} has no section {title!r}")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.DOTALL)
    if not blocks:
        raise AssertionError(f"{readme}'s section {title!r} has no python example")
    return "\n".join(blocks)


def run_readme_example(
    readme: pathlib.Path, tmp: pathlib.Path, nproc: int = 1, section: str | None = None
) -> str:
    """Runs the README's first example (or a section's blocks) alone (nproc 1) or under
    torchrun, in `tmp`; returns stdout."""
    script = tmp / "readme_example.py"
    script.write_text(
        readme_example(readme) if section is None else readme_section(readme, section)
    )
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    if nproc == 1:
        command = [sys.executable, str(script)]
        env = {"MASTER_PORT": port}
    else:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)),
            *("--master-port", port, str(script)),
        ]
        env = {}
    import os

    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def docs_tests(readme: pathlib.Path, cases: str, min_examples: int) -> tuple[Any, Any]:
    """The two tests every torch package runs on its docs (bind them in a test module).

    Args:
        readme: The package README.
        cases: The module (importable in the ranks) with `check_doctests()`.
        min_examples: How many docstring examples must have run, at least.
    """
    import pytest

    def test_docstring_examples_run(pools: Any) -> None:
        check = importlib.import_module(cases).check_doctests
        (result,) = pools[1].run(check)
        assert result["failed"] == 0, result["report"]
        assert result["attempted"] >= min_examples, result

    @pytest.mark.parametrize("nproc", [1, 3])
    def test_readme_example_runs(tmp_path: pathlib.Path, nproc: int) -> None:
        run_readme_example(readme, tmp_path, nproc)

    return test_docstring_examples_run, test_readme_example_runs
