"""AdamW8bit's blockwise update: the C++ kernel and the compiled pass equal the eager ops bit
for bit; which path runs, and why."""

import logging

import pytest
import torch

from ragged_optimizers import AdamW8bit, dequantize
from ragged_optimizers import _blockwise as blockwise
from ragged_optimizers import _native as native
from ragged_optimizers._kernel_args import Piece8bit


def _run(fused, shape, dtype, steps=4, lr_change=True, block_size=(32, 32), betas=(0.9, 0.999)):
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(dtype))
    opt = AdamW8bit(
        [param], lr=1e-2, min_8bit_numel=1, fused=fused, block_size=block_size, betas=betas
    )
    history = []
    for step in range(steps):
        grad = torch.randn(shape, generator=gen) * 0.01
        if step == 2:  # non-finite elements keep their value and reset their moments
            grad[0, 0], grad[-1, -1] = float("nan"), float("-inf")
            grad[0, -1] = float("inf")
        if step == 3 and lr_change:
            opt.param_groups[0]["lr"] = 3e-3
        param.grad = grad.to(dtype)
        opt.step()
        state = opt.state[param]
        history.append([param.detach().clone()] + [state[k].clone() for k in sorted(state)])
    return history, opt


def _assert_same_bits(reference, history):
    for step, (a, b) in enumerate(zip(reference, history, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), f"step {step}"


def _no_native(monkeypatch, why="no C++ compiler found"):
    def unavailable():
        raise native.NativeKernelError(why)

    monkeypatch.setattr(blockwise, "load_cpu_kernel", unavailable)


CASES = [
    ((96, 70), torch.float32, (32, 32)),  # partial blocks at the bottom and right
    ((200, 90), torch.float32, (32, 32)),
    ((64, 64), torch.bfloat16, (32, 32)),
    ((50, 33), torch.float16, (32, 32)),  # through a float32 copy
    ((40, 24), torch.float64, (8, 16)),
    ((1, 1), torch.float32, (32, 32)),
    ((7, 130), torch.float32, (2, 64)),
]


@pytest.mark.parametrize("shape, dtype, block_size", CASES)
def test_native_kernel_equals_eager_ops_bitwise(shape, dtype, block_size) -> None:
    eager, eager_opt = _run(False, shape, dtype, block_size=block_size)
    fused, fused_opt = _run(True, shape, dtype, block_size=block_size)
    assert fused_opt.kernel_paths["cpu"].kind == "native"
    assert eager_opt.kernel_paths["cpu"].kind == "eager"
    _assert_same_bits(eager, fused)
    assert not eager[-1][0].float().isnan().any()
    before, after = eager[1][0], eager[2][0]  # step 3 had non-finite gradients at corners
    assert after[0, 0] == before[0, 0] and after[-1, -1] == before[-1, -1]
    if shape != (1, 1):
        assert after[1, 1] != before[1, 1]
        _, codes, scales = eager[2][:3]  # sorted state keys: exp_avg, exp_avg_scale, ...
        m = dequantize(codes, scales, block_size, signed=True)
        assert m[0, 0] == 0 and m[-1, -1] == 0 and m[1, 1] != 0


def test_native_kernel_lerp_branch_and_threads_bitwise(monkeypatch) -> None:
    # beta1 = 0.3 takes lerp's other formula (weight 0.7 >= 0.5); 4 threads split the row
    # blocks of a piece large enough to be split (2^18 elements per thread).
    shape = (1024, 1100)
    eager, _ = _run(False, shape, torch.float32, steps=2, betas=(0.3, 0.99))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert native._num_threads(shape[0] * shape[1]) == 4
    fused, opt = _run(True, shape, torch.float32, steps=2, betas=(0.3, 0.99))
    assert opt.kernel_paths["cpu"].kind == "native"
    _assert_same_bits(eager, fused)


@pytest.mark.parametrize("shape, dtype", [((96, 70), torch.float32), ((64, 64), torch.bfloat16)])
def test_compiled_pass_equals_eager_ops_bitwise(monkeypatch, shape, dtype) -> None:
    eager, _ = _run(False, shape, dtype)
    _no_native(monkeypatch)
    compiled, compiled_opt = _run(True, shape, dtype)
    path = compiled_opt.kernel_paths["cpu"]
    assert path.kind == "compiled" and "no C++ compiler found" in path.reason
    _assert_same_bits(eager, compiled)


def test_kernel_paths_report_what_ran(monkeypatch, caplog) -> None:
    assert str(_run(False, (64, 64), torch.float32, 1)[1].kernel_paths["cpu"]) == (
        "eager (cpu: fused=False)"
    )
    assert str(_run(None, (64, 64), torch.float32, 1)[1].kernel_paths["cpu"]).startswith(
        "native (cpu, built in "
    )
    assert AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))]).kernel_paths == {}  # no step
    reference, _ = _run(False, (64, 64), torch.float32, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor is broken")

    _no_native(monkeypatch)
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="ragged_optimizers._blockwise"):
        history, opt = _run(None, (64, 64), torch.float32, 2)
    path = opt.kernel_paths["cpu"]
    assert path.kind == "eager"
    assert "no C++ compiler found" in path.reason and "inductor is broken" in path.reason
    assert "no C++ compiler found" in caplog.text and "inductor is broken" in caplog.text
    _assert_same_bits(reference, history)
    with pytest.raises(RuntimeError, match=r"fused=True.*inductor is broken"):
        _run(True, (64, 64), torch.float32, 1)


def test_native_build_failures_say_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RAGGED_OPTIMIZERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.load_cpu_kernel.cache_clear()
    try:
        with pytest.raises(native.NativeKernelError, match=r"no C\+\+ compiler found"):
            native.load_cpu_kernel()
        monkeypatch.undo()
        monkeypatch.setenv("RAGGED_OPTIMIZERS_CACHE", str(tmp_path / "cache"))
        broken = tmp_path / "broken.cpp"
        broken.write_text("this is not C++\n")
        monkeypatch.setattr(native, "_SOURCE", broken)
        with pytest.raises(native.NativeKernelError, match=r"failed \(1\).*broken\.cpp"):
            native.load_cpu_kernel()
        assert not list((tmp_path / "cache").iterdir())  # no partial library left behind
    finally:
        native.load_cpu_kernel.cache_clear()


def test_native_kernel_is_cached_per_source(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RAGGED_OPTIMIZERS_CACHE", str(tmp_path))
    native.load_cpu_kernel.cache_clear()
    try:
        first = native.load_cpu_kernel()
        native.load_cpu_kernel.cache_clear()
        again = native.load_cpu_kernel()
        assert first.library == again.library and first.library.parent == tmp_path
        assert [p.name for p in tmp_path.iterdir()] == [first.library.name]
        changed = tmp_path / "changed.cpp"
        changed.write_text(native._SOURCE.read_text() + "\n// another version\n")
        monkeypatch.setattr(native, "_SOURCE", changed)
        native.load_cpu_kernel.cache_clear()
        assert native.load_cpu_kernel().library != first.library
    finally:
        native.load_cpu_kernel.cache_clear()


def test_fused_choices(monkeypatch) -> None:
    for bad in ("yes", 1, 0.0):
        with pytest.raises(
            ValueError,
            match=f"fused must be None, True, False, 'native' or 'compiled', got {bad!r}",
        ):
            AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))], fused=bad)  # type: ignore[arg-type]
    assert _run("compiled", (64, 64), torch.float32, 1)[1].kernel_paths["cpu"].kind == "compiled"
    assert _run("native", (64, 64), torch.float32, 1)[1].kernel_paths["cpu"].kind == "native"
    meta = torch.nn.Parameter(torch.zeros(64, 64, device="meta"))
    meta.grad = torch.zeros_like(meta)
    with pytest.raises(RuntimeError, match=r"fused='native'\) is the CPU kernel; for meta"):
        AdamW8bit([meta], fused="native").step()
    _no_native(monkeypatch)
    with pytest.raises(RuntimeError, match=r"fused='native'\): no C\+\+ compiler found"):
        _run("native", (64, 64), torch.float32, 1)


def test_native_kernel_refuses_buffers_it_would_overrun() -> None:
    # The C++ side trusts its pointers: every buffer is checked before the call.
    kernel = native.load_cpu_kernel()
    rows, cols, block = 40, 70, (32, 32)
    grid = 2 * 3  # row blocks x column blocks

    def buffers(**changed: torch.Tensor) -> dict[str, torch.Tensor]:
        given = {
            "param": torch.zeros(rows, cols),
            "grad": torch.ones(rows, cols),
            "exp_avg": torch.zeros(rows, cols, dtype=torch.uint8),
            "exp_avg_scale": torch.zeros(grid),
            "exp_avg_sq": torch.zeros(rows, cols, dtype=torch.uint8),
            "exp_avg_sq_scale": torch.zeros(grid),
        }
        return given | changed

    scalars = blockwise.step_scalars(
        step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, device=torch.device("cpu")
    )
    tables = blockwise.code_tables(torch.device("cpu"))
    ok = buffers()
    kernel(Piece8bit(**ok), scalars, tables, block)
    assert ok["param"].ne(0).all()  # the well-formed call ran
    bad = [
        ("exp_avg_scale", torch.zeros(grid - 1), "5 torch.float32"),
        ("exp_avg_sq", torch.zeros(rows, cols - 1, dtype=torch.uint8), "2760 torch.uint8"),
        ("exp_avg", torch.zeros(rows, cols), "2800 torch.float32"),
        ("grad", torch.ones(rows - 1, cols), "2730 torch.float32"),
        ("exp_avg_sq_scale", torch.zeros(grid * 2)[::2], "contiguous"),
    ]
    for name, tensor, got in bad:
        given = buffers(**{name: tensor})
        with pytest.raises(ValueError, match=f"{name}.*{got}"):
            kernel(Piece8bit(**given), scalars, tables, block)
        assert given["param"].eq(0).all(), name  # refused before the kernel wrote anything
    before = ok["param"].clone()
    with pytest.raises(ValueError, match="scalars must be 7"):
        kernel(Piece8bit(**ok), scalars[:6], tables, block)
    with pytest.raises(ValueError, match="signed_lookup must be 131072"):
        kernel(Piece8bit(**ok), scalars, (*tables[:2], tables[2][:-1], tables[3]), block)
    assert torch.equal(before, ok["param"])  # refused calls wrote nothing
