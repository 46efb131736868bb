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


# -- rooms: no import circle, files and functions a reader can hold -----------------------------

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # of code: the docstring does not count


def _sources(module: str) -> dict[str, pathlib.Path]:
    """Every module of a package by dotted name (a package's `__init__` by the package's)."""
    folder = next(ROOT.glob(f"packages/*/src/{module}"))
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, prefix: str) -> set[str]:
    """Modules under `prefix` that `path` imports (type-only imports too: a design circle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(prefix))
    return found


@pytest.mark.parametrize("module", [m for _, _, m in TABLE])
def test_no_import_circle_between_a_packages_modules(module) -> None:
    # A package's `__init__` re-exports its rooms (a facade), so imports of a package are not
    # edges; between two rooms any import is one, type-only ones too.
    sources = _sources(module)
    packages = {name for name, path in sources.items() if path.name == "__init__.py"}
    edges = {
        name: _imports(path, module) - packages - {name}
        for name, path in sources.items()
        if name not in packages
    }

    def circle_from(start: str) -> list[str] | None:
        path, seen = [start], set()

        def walk(node: str) -> list[str] | None:
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    path.append(nxt)
                    found = walk(nxt)
                    if found:
                        return found
                    path.pop()
            return None

        return walk(start)

    for name in sorted(edges):
        circle = circle_from(name)
        assert circle is None, " -> ".join(circle)


@pytest.mark.parametrize("module", [m for _, _, m in TABLE])
def test_files_and_functions_stay_readable(module) -> None:
    long_files, long_functions = [], []
    for name, path in _sources(module).items():
        lines = path.read_text().count("\n")
        if lines > MAX_FILE_LINES:
            long_files.append(f"{name} ({lines})")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            first = body[0]
            documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            start = (
                (body[1].lineno if len(body) > 1 else first.end_lineno)
                if documented
                else first.lineno
            )
            length = (node.end_lineno or start) - start + 1
            if length > MAX_FUNCTION_LINES:
                long_functions.append(f"{name}.{node.name} ({length})")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, (
        f"functions over {MAX_FUNCTION_LINES} lines of code: {long_functions}"
    )


# What each package's compat module hands the rest of the package: every use of a torch
# internal goes through these names. A new one is added here on purpose, and documented.
COMPAT_EXPORTS = {
    "ragged_placement._compat": [
        "DTensorSpec", "DispatchMode", "OpOverload", "OpSchema", "OutputSharding",
        "SUPPORTED_TORCH", "TensorMeta", "WeightedMeanPartial", "all_gather_single",
        "are_we_tracing", "async_all_gather", "async_all_to_all", "check_torch_version",
        "contiguous_strides", "current_mesh", "dispatch_without_handler", "rewritten_call",
        "dtensor_locals", "dtensor_random_ops", "install", "local_of", "locals_and_specs_of",
        "locals_of", "make_dtensor", "make_dtensors", "norm_partial", "op_arguments",
        "process_group_from_op_arg", "redirect", "spec_of", "specs_of", "torch_version",
    ],
    "dbuffer._compat": [
        "TENSOR_DATA_GET", "TENSOR_IS_VIEW", "all_gather_single", "base_of",
        "concatenate_meshes", "foreach_add_", "foreach_copy_", "is_view", "plain_tensor_ops",
        "profiler_range", "reduce_scatter_single", "set_version", "storage_key", "version_of",
    ],
    "fsdp_engine._compat": [
        "ApplyOverride", "TorchFSDPModule", "TorchGradientReductionHandle",
        "TorchUnshardHandle", "all_gather_single", "dtensor_spec", "flatten_axes",
        "foreach_mul_", "foreach_norm", "fully_shard_state", "in_backward", "map_tensors",
        "mark_fsdp_managed", "parameter_slots", "placement_result",
        "post_accumulate_grad_hooks", "profiler_range", "queue_backward_callback",
        "set_fully_shard_state", "torch_fsdp_methods",
    ],
    "ragged_optimizers._compat": [
        "all_gather_single", "compile_options", "foreach_add_", "foreach_lerp", "foreach_lerp_",
        "foreach_mul_", "mark_dims_dynamic",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COMPAT_EXPORTS))
def test_compat_modules_export_what_is_listed_and_say_what_each_is(name) -> None:
    pytest.importorskip("torch")
    import importlib

    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(COMPAT_EXPORTS[name]), sorted(module.__all__)
    doc = module.__doc__ or ""
    undocumented = [n for n in module.__all__ if f"`{n}" not in doc]
    assert not undocumented, f"{name}'s docstring does not say what these are: {undocumented}"
    # Nothing else public: the rest of the package reaches torch's internals through __all__.
    public = {n for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    imported = {n for n, v in vars(module).items() if getattr(v, "__module__", "") != name}
    extra = sorted(public - set(module.__all__) - imported - {"annotations"})
    assert not extra, f"{name} defines public names outside __all__: {extra}"
