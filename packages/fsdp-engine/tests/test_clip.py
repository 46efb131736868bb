"""fsdp_engine.clip_grad_norm_ on one process: torch's results; across meshes: tp_cases."""

import math

import pytest
import torch

from fsdp_engine import clip_grad_norm_


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (5,), (2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_equals_torch_on_plain_tensors(norm_type, max_norm) -> None:
    ours, theirs = _params(0), _params(0)
    got = clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    torch.testing.assert_close(got, expected)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_edge_cases_and_bad_input() -> None:
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0)) == 0.0
    one = _params(1)[0]
    assert float(clip_grad_norm_(one, 1e9)) == float(one.grad.norm())  # a single tensor
    for bad in (-1.0, True, "1"):
        with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
            clip_grad_norm_(_params(2), bad)  # type: ignore[arg-type]
    for bad in ("pp", 2):
        with pytest.raises(ValueError, match="pp_mesh must be a 1-D DeviceMesh or None"):
            clip_grad_norm_(_params(2), 1.0, pp_mesh=bad)  # type: ignore[arg-type]
    params = _params(3)
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
