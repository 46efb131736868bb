"""Task runner for the ragged-fsdp monorepo.

`nox` runs the default sessions (what CI runs); `nox -l` lists every session with its docstring.
We use nox's default pip-based virtualenvs on purpose: pip finds the torch wheels stored on
these machines, uv does not and would download multi-GB CUDA builds.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).parent
# Bottom-up in the dependency order of docs/architecture.md; installs and type checks follow it.
PACKAGES = {
    "shard-planner": "shard_planner",
    "ragged-placement": "ragged_placement",
    "dbuffer": "dbuffer",
    "fsdp-engine": "fsdp_engine",
    "optimizers": "ragged_optimizers",
}
# Every supported minor (`nox -s tests`). The default run (CI) tests the oldest and the newest,
# where a torch change breaks a compat module first; two of them keep CI well under its limit
# on a loaded 2-core machine (three took 70 minutes there).
TORCH_ALL = ["2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
TORCH_CI = ["2.10.0", "2.15.0"]
TORCH_DEFAULT = "2.13.0"  # a CPU wheel stored on these machines
TORCH_GPU = "2.14.1"  # the CUDA build stored on these machines
# These machines' pip constraint caps torch at the stored 2.14.1; a session asking for a newer
# torch lifts it for its own installs (an empty constraints file replaces the machine's).
TORCH_CAP = (2, 14)
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100"]
# DCP needs numpy; examples/train.py tqdm; the engine's tests build transformers models
# and torch's DTensor test Transformer (whose module imports expecttest); torchao's
# compiled AdamW8bit runs on RaggedShard parameters (tests/test_compile_cache.py; on a torch
# older than 2.11 torchao skips its C++ kernels, which those tests do not use).
TORCH_TEST_DEPS = [
    *TEST_DEPS,
    "numpy",
    "tqdm",
    "transformers>=5.17,<5.19",
    "expecttest",
    "torchao>=0.18,<0.19",
]
# Frameworks that drive FSDP2, run with ours swapped in (tests/test_torchtitan.py,
# test_accelerate.py): torchtitan 0.3.0 needs torch >= 2.14 and brings spmd_types (the
# spmd_types parameter tests); installed with the newest torch only.
FRAMEWORK_DEPS = {(2, 15): ["torchtitan==0.3.0", "accelerate==1.15.0"]}
# A CUDA torch venv takes 5-7 GB, and CI's disk is shared: three of them side by side once
# filled it. `.ci/run` sets this, and each test session then removes its venv when it ends.
DROP_TEST_VENVS = os.environ.get("RAGGED_FSDP_DROP_TEST_VENVS") == "1"

nox.options.sessions = ["lint", "typecheck", "planner", "build", *(f"tests({v})" for v in TORCH_CI)]


def _install_members(session: nox.Session, torch_version: str | None) -> None:
    # One pip call: pip satisfies the sibling version ranges from the local editables.
    args = [f"torch=={torch_version}"] if torch_version else []
    minor = tuple(int(p) for p in torch_version.split(".")[:2]) if torch_version else None
    if minor and minor > TORCH_CAP:
        session.env["PIP_CONSTRAINT"] = os.devnull
    for folder in PACKAGES:
        args += ["-e", str(ROOT / "packages" / folder)]
    frameworks = FRAMEWORK_DEPS.get(minor, []) if minor else []
    session.install(*args, *TORCH_TEST_DEPS, *frameworks)


@nox.session
@nox.parametrize("torch", TORCH_ALL, ids=TORCH_ALL)
def tests(session: nox.Session, torch: str) -> None:
    """Run every CPU test of every package against one torch (the default run: 2.10 and 2.15).

    Pass pytest arguments after `--`, e.g. `nox -s "tests(2.13.0)" -- packages/shard-planner -x`;
    `nox -s tests` runs all six supported minors.
    """
    try:
        _install_members(session, torch)
        session.run("pytest", "-m", "not gpu", *(session.posargs or ["tests", "packages"]))
    finally:
        if DROP_TEST_VENVS:
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session
def planner(session: nox.Session) -> None:
    """Test shard-planner alone in a venv WITHOUT torch (it must stay pure Python)."""
    session.install("-e", "packages/shard-planner", *TEST_DEPS)
    session.run(
        "python",
        "-c",
        "import importlib.util, sys; "
        "sys.exit('torch is installed in the planner venv' "
        "if importlib.util.find_spec('torch') else 0)",
    )
    session.run("pytest", "packages/shard-planner/tests", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on each package's src/ (one at a time), examples/ and tools/ (torch 2.13)."""
    _install_members(session, TORCH_DEFAULT)
    session.install("mypy>=1.10")
    # One package per run (each must type-check on its own), one cache for all of them: torch
    # and the packages below are analysed once, not once per package.
    for folder in PACKAGES:
        source = ROOT / "packages" / folder / "src"
        session.run("mypy", "--cache-dir", str(ROOT / ".mypy_cache"), str(source))
    # The scripts users run (and the benchmarks they import), strict too.
    session.run("mypy", "--cache-dir", str(ROOT / ".mypy_cache"), "examples", "tools")


@nox.session
def lint(session: nox.Session) -> None:
    """Run ruff (lint rules and formatting check) over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def build(session: nox.Session) -> None:
    """Build each package's wheel and sdist, then install each wheel alone in a fresh venv;
    then run each `pip install` line of the README's Install section in a fresh venv.

    Sibling dependencies of a wheel resolve only from the freshly built wheels (no index), so
    this proves that every package's published metadata is complete. torch-dependent packages
    see the CPU torch 2.13.0, installed once for all of them (and numpy, for the wheels: the
    README's lines must bring it themselves). The line that installs the engine then runs the
    README's Quick start (the import swap and `dcp.save`) on 2 gloo ranks.
    """
    session.install("build>=1.2")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for folder in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), f"packages/{folder}")
    with tempfile.TemporaryDirectory() as torch_tmp:
        # The third-party dependencies are installed once, into folders of their own, and
        # each fresh venv sees them through a .pth file (pip there counts them as
        # installed): torch alone, and numpy beside it for the wheels installed without an
        # index (ragged-placement needs numpy; the README's lines must bring it themselves).
        torch_site = pathlib.Path(torch_tmp) / "torch"
        numpy_site = pathlib.Path(torch_tmp) / "numpy"
        pip_target = ("python", "-m", "pip", "install", "-q", "--target")
        session.run(*pip_target, str(torch_site), f"torch=={TORCH_DEFAULT}")
        session.run(*pip_target, str(numpy_site), "numpy")
        for module in PACKAGES.values():
            _check_wheel_alone(session, dist, module, [torch_site, numpy_site])
        for line in _readme_install_lines():
            _check_install_line(session, line, torch_site)


def _readme_install_lines() -> list[list[str]]:
    """The `pip install` lines of the root README's Install section, as argument lists."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Install\n")
    section = text[start : text.index("\n## ", start + 1)]
    lines = [line.split()[2:] for line in section.splitlines() if line.startswith("pip install")]
    if not lines:
        raise RuntimeError("the README's Install section has no `pip install` line")
    return lines


def _readme_quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Quick start\n")
    return text[start:].split("```python\n", 1)[1].split("```", 1)[0]


def _new_venv(session: nox.Session, folder: pathlib.Path, sites: list[pathlib.Path]) -> str:
    """A venv without pip (the session's pip installs into it) seeing `sites`; its python."""
    session.run("python", "-m", "venv", "--without-pip", str(folder))
    python = str(folder / "bin" / "python")
    if sites:
        site = session.run(
            python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
            external=True, silent=True,
        )  # fmt: skip
        assert isinstance(site, str)
        (pathlib.Path(site.strip()) / "shared_site.pth").write_text(
            "".join(f"{s}\n" for s in sites)
        )
    return python


def _check_install_line(session: nox.Session, args: list[str], torch_site: pathlib.Path) -> None:
    """Runs one README install line in a fresh venv (folders from the repository root, the
    index for their build backend and numpy), imports what it installed, and for the full
    line runs the README's Quick start on 2 ranks."""
    folders = [pathlib.Path(a).name for a in args if a.startswith("./packages/")]
    if len(folders) != len(args) or not set(folders) <= set(PACKAGES):
        session.error(f"README install line names something other than package folders: {args}")
    modules = [PACKAGES[f] for f in folders]
    session.log(f"README install line: pip install {' '.join(args)}")
    with tempfile.TemporaryDirectory() as tmp:
        needs_torch = folders != ["shard-planner"]
        python = _new_venv(session, pathlib.Path(tmp) / "venv", [torch_site] if needs_torch else [])
        paths = [str(ROOT / "packages" / f) for f in folders]
        session.run("python", "-m", "pip", "--python", python, "install", "-q", *paths)
        check = "; ".join(f"import {m}" for m in modules)
        if not needs_torch:
            check += "; import sys; assert 'torch' not in sys.modules"
        session.run(python, "-c", check, external=True)
        if "fsdp_engine" in modules:
            script = pathlib.Path(tmp) / "quick_start.py"
            script.write_text(_readme_quick_start())
            with session.chdir(tmp):
                session.run(
                    python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(script), external=True, env={"OMP_NUM_THREADS": "1"},
                )  # fmt: skip
            if not (pathlib.Path(tmp) / "checkpoint" / ".metadata").is_file():
                session.error("the README's Quick start wrote no DCP checkpoint")


def _check_wheel_alone(
    session: nox.Session, dist: pathlib.Path, module: str, sites: list[pathlib.Path]
) -> None:
    wheels = sorted(dist.glob(f"{module}-*.whl"))
    if len(wheels) != 1:
        session.error(f"expected one wheel for {module} in {dist}, found {wheels}")
    with tempfile.TemporaryDirectory() as tmp:
        needs = [] if module == "shard_planner" else sites
        python = _new_venv(session, pathlib.Path(tmp) / "venv", needs)
        pip = ["python", "-m", "pip", "--python", python, "install", "-q"]
        session.run(*pip, "--no-index", "--find-links", str(dist), str(wheels[0]))
        check = f"import {module}; print({module}.__name__, {module}.__version__)"
        if module == "shard_planner":
            check += "; import sys; assert 'torch' not in sys.modules"
            check += "; assert shard_planner.load_preset('llama3-8b').groups"
        if module == "ragged_optimizers":  # the CPU kernel's source ships in the wheel
            check += "; from ragged_optimizers import _native; assert _native._SOURCE.is_file()"
        session.run(python, "-c", check, external=True)


@nox.session(default=False, venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """Run the `gpu`-marked tests on a CUDA machine; skips cleanly without CUDA.

    Against the machine's own torch where it has one (with pytest): nothing is installed, the
    packages run from their sources (a GPU machine may have no package index). Otherwise
    torch 2.14.1 (the CUDA build stored on these machines) and the packages are installed.
    """
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        session.skip("no CUDA device on this machine")
    found = session.run(
        "python", "-c",
        "import importlib.util as u; print(all(u.find_spec(m) for m in ('torch', 'pytest')))",
        silent=True,
    )  # fmt: skip
    if isinstance(found, str) and found.strip() == "True":
        sources = [str(ROOT / "packages" / folder / "src") for folder in PACKAGES]
        session.env["PYTHONPATH"] = os.pathsep.join([*sources, str(ROOT / "examples")])
    else:
        _install_members(session, TORCH_GPU)
    session.run("python", "-m", "pytest", "-m", "gpu", *(session.posargs or ["tests", "packages"]))


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: train on Shakespeare with our engine, then with torch FSDP2, and compare.

    Then once more with ours gathering its matrices as fp8 (`--gather fp8`): a third column;
    then both engines' step times, alternated in one run. Two gloo ranks on CPU each; prints
    the side-by-side table and writes the loss curves to build/demo/loss.png. Then plans the
    real model presets and compares padding with FSDP2 (tables on stdout, plots in
    build/demo/<preset>.png). Pass train.py options after `--`.
    """
    steps = 6
    session.log(
        f"demo 1/{steps}: installing torch and the five packages into .nox/demo (a few minutes "
        f"the first time, seconds after)"
    )
    _install_members(session, TORCH_DEFAULT)
    session.install("tqdm", "matplotlib", "-e", "packages/shard-planner[plot]")
    out = ROOT / "build" / "demo"
    out.mkdir(parents=True, exist_ok=True)
    # The measured steps run under torch's profiler, whose CPU allocator warns about every
    # block allocated before it started: measurement noise, not the run's.
    quiet = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    # Ours, FSDP2, then ours again with fp8 parameter gathers (in a folder of its own).
    runs = (("ours", "param", out), ("fsdp2", "param", out), ("ours", "fp8", out / "fp8"))
    for step, (engine, gather, folder) in enumerate(runs, start=2):
        session.log(
            f"demo {step}/{steps}: training 300 steps on 2 gloo ranks with --engine {engine} "
            f"--gather {gather} (about a minute here; a progress bar follows)"
        )
        session.run(
            "python", "examples/train.py", "--nproc", "2", "--engine", engine,
            "--gather", gather, "--out", str(folder), *session.posargs, env=quiet,
        )  # fmt: skip
    session.log(
        f"demo 5/{steps}: step times of both engines, alternated in one run (10 rounds; "
        f"about a minute)"
    )
    session.run(
        "python", "examples/train.py", "--nproc", "2", "--alternate", "10", "--out", str(out),
        *session.posargs, env=quiet,
    )  # fmt: skip
    session.log(
        f"demo 6/{steps}: the side-by-side table, then the planner's padding on four model "
        f"presets (seconds)"
    )
    session.run(
        "python", "examples/report.py", str(out / "ours.json"), str(out / "fsdp2.json"),
        str(out / "fp8" / "ours.json"), "--timing", str(out / "timing.json"),
        "--plot", str(out / "loss.png"),
    )  # fmt: skip
    for preset in ("llama3-8b", "deepseek-v3-671b", "gpt-oss-120b", "qwen3-30b-a3b"):
        session.run(
            "shard-planner", "compare", "--preset", preset,
            "--world-sizes", "8,64,256,1024,3072,8192", "--block-rows", "1,32",
            "--plot", str(out / f"{preset}.png"),
        )  # fmt: skip


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run a benchmark: `nox -s bench -- NAME [args]`.

    NAME: planner, placement, dbuffer, engine, overhead, guard or optimizers.
    """
    which = session.posargs[0] if session.posargs else "planner"
    scripts = {
        "planner": "packages/shard-planner/benchmarks/bench_planner.py",
        "placement": "packages/ragged-placement/benchmarks/bench_placement.py",
        "dbuffer": "packages/dbuffer/benchmarks/bench_dbuffer.py",
        "engine": "packages/fsdp-engine/benchmarks/bench_engine.py",
        "overhead": "packages/fsdp-engine/benchmarks/bench_overhead.py",
        "guard": "packages/fsdp-engine/benchmarks/bench_guard.py",
        "optimizers": "packages/optimizers/benchmarks/bench_optimizers.py",
    }
    if which not in scripts:
        session.error(f"unknown benchmark {which!r}; valid: {', '.join(scripts)}")
    if which == "planner":
        session.install("-e", "packages/shard-planner")
    else:
        _install_members(session, TORCH_DEFAULT)
        session.install("matplotlib")
    session.run("python", scripts[which], *session.posargs[1:])
