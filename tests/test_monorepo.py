"""Repository-wide rules (docs/architecture.md), checked on every package's metadata."""

import ast
import importlib.metadata
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Bottom-up, as in docs/architecture.md's package table: a package may depend only on earlier rows.
TABLE = [
    ("shard-planner", "shard-planner", "shard_planner"),
    ("ragged-placement", "ragged-placement", "ragged_placement"),
    ("dbuffer", "dbuffer", "dbuffer"),
    ("fsdp-engine", "fsdp-engine", "fsdp_engine"),
    ("optimizers", "ragged-optimizers", "ragged_optimizers"),
]
DISTRIBUTIONS = [dist for _, dist, _ in TABLE]


def _project(folder: str) -> dict:
    return tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())


def test_every_package_folder_is_in_the_table() -> None:
    assert sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir()) == sorted(
        folder for folder, _, _ in TABLE
    )


@pytest.mark.parametrize(("row", "entry"), list(enumerate(TABLE)), ids=DISTRIBUTIONS)
def test_package_layout_and_dependencies(row, entry) -> None:
    folder, dist, module = entry
    base = ROOT / "packages" / folder
    project = _project(folder)["project"]
    assert project["name"] == dist
    for needed in ("README.md", "tests", f"src/{module}/__init__.py", f"src/{module}/py.typed"):
        assert (base / needed).exists(), f"{folder} lacks {needed}"
    siblings = []
    for requirement in project.get("dependencies", []):
        assert "@" not in requirement and "file:" not in requirement, "no path references"
        name = re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0]
        if name in DISTRIBUTIONS:
            siblings.append(name)
            assert re.search(r">=\d", requirement), f"{dist}: pin {requirement} with a range"
    allowed = set(DISTRIBUTIONS[:row])
    assert set(siblings) <= allowed, f"{dist} depends upward: {set(siblings) - allowed}"
    imported = _imported_siblings(base / "src" / module) - {dist}
    assert set(siblings) == imported, (
        f"{dist} declares {sorted(siblings)} but its source imports {sorted(imported)}"
    )
    if module == "shard_planner":
        assert project.get("dependencies", []) == [], "shard-planner has no dependencies"


def _imported_siblings(source: pathlib.Path) -> set[str]:
    """The distributions of the table whose modules `source`'s files import, anywhere in them."""
    by_module = {module: dist for _, dist, module in TABLE}
    found = set()
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found |= {by_module[n.split(".")[0]] for n in names if n.split(".")[0] in by_module}
    return found


@pytest.mark.parametrize(("folder", "dist", "module"), TABLE, ids=DISTRIBUTIONS)
def test_installed_version_is_the_source_version(folder, dist, module) -> None:
    init = (ROOT / "packages" / folder / "src" / module / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', init, re.M).group(1)
    assert importlib.metadata.version(dist) == version


def test_ci_keeps_one_torch_venv_at_a_time() -> None:
    # Three CUDA torch venvs side by side (5-7 GB each) once filled CI's disk: the variable that
    # makes the noxfile remove each test venv must be the one `.ci/run` sets.
    noxfile = (ROOT / "noxfile.py").read_text()
    read = re.search(r'os\.environ\.get\("(\w+)"\) == "1"', noxfile)
    assert read, "noxfile.py reads no variable that drops the test venvs"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^export {read[1]}=1$", ci, re.M), f".ci/run does not set {read[1]}"


def test_helper_modules_on_pytest_pythonpath_have_unique_names() -> None:
    # pytest's `pythonpath` puts every tests folder on sys.path: a helper module named like
    # another folder's would shadow it silently in whichever imports second. Test modules
    # (test_*.py, conftest.py) are imported by path (--import-mode=importlib), so they may
    # repeat.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = config["tool"]["pytest"]["ini_options"]["pythonpath"]
    assert "packages/dbuffer/tests" in folders, folders
    owners: dict[str, list[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name.startswith("test_") or path.name == "conftest.py":
                continue
            owners.setdefault(path.stem, []).append(folder)
    repeated = {name: where for name, where in owners.items() if len(where) > 1}
    assert not repeated, f"helper modules named alike in several pythonpath folders: {repeated}"
    assert "rank_pool" in owners and "dbuffer_cases" in owners, sorted(owners)
