"""The READMEs as a newcomer reads them: guides with the same headings, install lines that
resolve, a quick start that runs, and no lab notebook (measurements live in docs/)."""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ["shard-planner", "ragged-placement", "dbuffer", "fsdp-engine", "optimizers"]
READMES = [ROOT / "README.md", *(ROOT / "packages" / f / "README.md" for f in FOLDERS)]


def _headings(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # not `# comments`
    return [line[3:] for line in text.splitlines() if line.startswith("## ")]


def test_root_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 150, len(lines)
    assert _headings(ROOT / "README.md") == [
        "Why", "Install", "Quick start", "Saving and loading", "Limits", "Packages",
        "The two commands",
    ]  # fmt: skip


@pytest.mark.parametrize("folder", FOLDERS)
def test_package_readme_is_a_guide(folder) -> None:
    readme = ROOT / "packages" / folder / "README.md"
    headings = _headings(readme)
    for needed in ("Install", "Limits"):
        assert needed in headings, f"{folder}: no '## {needed}' in {headings}"
    first = headings[:3]
    assert "Install" in first, f"{folder}: Install comes first, got {headings}"
    assert any(h in first for h in ("Quick start", "Plan my model")), headings
    text = readme.read_text()
    # Measurements beyond the headline figures live in docs/, linked from the guide.
    assert "docs/benchmarks.md" in text or "docs/shard-planner.md" in text, folder


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_no_readme_keeps_a_ci_timing_history(readme) -> None:
    for paragraph in readme.read_text().split("\n\n"):
        lowered = paragraph.lower()
        if ".ci/run" in lowered or re.search(r"\bci\b", lowered):
            assert not re.search(r"\d+(\.\d+)? (minutes|min)\b|\(\d[\d,]* s\)", lowered), (
                f"{readme}: a CI wall time belongs in docs/benchmarks.md:\n{paragraph}"
            )


def _install_lines() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Install\n")
    section = text[start : text.index("\n## ", start + 1)]
    return [line.split()[2:] for line in section.splitlines() if line.startswith("pip install")]


def _sibling_folders(folder: str) -> set[str]:
    project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())
    names = {
        tomllib.loads((ROOT / "packages" / f / "pyproject.toml").read_text())["project"]["name"]: f
        for f in FOLDERS
    }
    found = set()
    for requirement in project["project"].get("dependencies", []):
        name = re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0]
        if name in names:
            found.add(names[name])
    return found


def test_each_install_line_lists_every_sibling_it_needs() -> None:
    """pip resolves a sibling only from the folders on its command line (no index has them);
    `nox -s build` runs each line in a fresh venv."""
    lines = _install_lines()
    assert len(lines) >= 2 and any(len(line) == len(FOLDERS) for line in lines), lines
    readmes = [ROOT / "packages" / f / "README.md" for f in FOLDERS]
    for readme in readmes:  # the package guides' own install lines too
        for line in readme.read_text().splitlines():
            if line.startswith("pip install ./packages/"):
                lines.append([part for part in line.split()[2:] if part.startswith("./")])
    for line in lines:
        folders = {part.removeprefix("./packages/").strip('"') for part in line}
        folders = {f.split("[")[0] for f in folders}
        assert folders <= set(FOLDERS), line
        for folder in folders:
            missing = _sibling_folders(folder) - folders
            assert not missing, f"`pip install {' '.join(line)}` lacks {sorted(missing)}"


def test_root_quick_start_runs_under_torchrun(tmp_path) -> None:
    pytest.importorskip("torch")
    from doctest_support import run_readme_example

    run_readme_example(ROOT / "README.md", tmp_path, nproc=2)
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
