"""AdamW8bit's blockwise update: the compiled pass equals the eager ops bit for bit, paths."""

import logging

import pytest
import torch

from ragged_optimizers import AdamW8bit, dequantize


def _run(fused, shape, dtype, steps=4, lr_change=True):
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(dtype))
    opt = AdamW8bit([param], lr=1e-2, min_8bit_numel=1, fused=fused)
    history = []
    for step in range(steps):
        grad = torch.randn(shape, generator=gen) * 0.01
        if step == 2:  # non-finite elements keep their value and reset their moments
            grad[0, 0], grad[-1, -1] = float("nan"), float("-inf")
        if step == 3 and lr_change:
            opt.param_groups[0]["lr"] = 3e-3
        param.grad = grad.to(dtype)
        opt.step()
        state = opt.state[param]
        history.append([param.detach().clone()] + [state[k].clone() for k in sorted(state)])
    return history, opt


@pytest.mark.parametrize(
    "shape, dtype",
    [((96, 70), torch.float32), ((200, 90), torch.float32), ((64, 64), torch.bfloat16)],
)
def test_compiled_pass_equals_eager_ops_bitwise(shape, dtype) -> None:
    eager, eager_opt = _run(False, shape, dtype)
    compiled, compiled_opt = _run(True, shape, dtype)
    assert compiled_opt.kernel_paths["cpu"].compiled
    assert not eager_opt.kernel_paths["cpu"].compiled
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), f"step {step}"
    assert not eager[-1][0].float().isnan().any()
    before, after = eager[1][0], eager[2][0]  # step 3 had non-finite gradients at two corners
    assert after[0, 0] == before[0, 0] and after[-1, -1] == before[-1, -1]
    assert after[1, 1] != before[1, 1]
    _, codes, scales = eager[2][:3]  # sorted state keys: exp_avg, exp_avg_scale, ...
    m = dequantize(codes, scales, (32, 32), signed=True)
    assert m[0, 0] == 0 and m[-1, -1] == 0 and m[1, 1] != 0


def test_kernel_paths_report_what_ran(monkeypatch, caplog) -> None:
    assert str(_run(False, (64, 64), torch.float32, 1)[1].kernel_paths["cpu"]) == (
        "eager (cpu: fused=False)"
    )
    assert AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))]).kernel_paths == {}  # no step
    reference, _ = _run(False, (64, 64), torch.float32, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="ragged_optimizers._blockwise"):
        history, opt = _run(None, (64, 64), torch.float32, 2)
    path = opt.kernel_paths["cpu"]
    assert not path.compiled and "no C++ compiler" in path.reason
    assert "no C++ compiler" in caplog.text
    for a, b in zip(reference, history, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(RuntimeError, match=r"fused=True.*no C\+\+ compiler"):
        _run(True, (64, 64), torch.float32, 1)


def test_bad_fused_value() -> None:
    with pytest.raises(ValueError, match="fused must be True, False or None, got 'yes'"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))], fused="yes")  # type: ignore[arg-type]
