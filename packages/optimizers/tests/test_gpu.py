"""On CUDA: AdamW8bit's compiled (Triton) update against the CPU's bits; Muon's runs and
heads against separate matrices on the same device."""

import pytest
import torch

from ragged_optimizers import AdamW8bit, Muon

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _steps(device: str, fused: bool | None, steps: int = 3) -> tuple[list[torch.Tensor], AdamW8bit]:
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(300, 200, generator=gen) * 0.1).to(device))
    opt = AdamW8bit([param], lr=1e-2, min_8bit_numel=1, fused=fused)
    for _ in range(steps):
        param.grad = (torch.randn(300, 200, generator=gen) * 0.01).to(device)
        opt.step()
    state = opt.state[param]
    return [param.detach().cpu()] + [state[k].cpu() for k in sorted(state) if k != "step"], opt


def test_cuda_compiled_update_matches_cpu() -> None:
    cpu, _ = _steps("cpu", False)
    cuda, opt = _steps("cuda", None)
    assert opt.kernel_paths["cuda"].kind == "compiled", opt.kernel_paths
    param, m_codes, m_scales, v_codes, v_scales = cuda
    # Triton's float32 arithmetic may round differently from the CPU's IEEE one (a few ulps,
    # and in another order): of the parameter itself (rtol 1e-6, 8 ulps), and of each step's
    # move lr x m / (sqrt(v) + eps), at most about lr: 3 steps x lr x 4 ulps of 1 (2^-21) =
    # 1.4e-8 where a parameter is near 0. Measured on torch 2.11 / H100: 2.6e-7 relative,
    # 6.2e-9 absolute near 0. A code may move to a neighbour.
    torch.testing.assert_close(param, cpu[0], rtol=1e-6, atol=3 * 1e-2 * 2**-21)
    torch.testing.assert_close(m_scales, cpu[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(v_scales, cpu[4], rtol=1e-6, atol=0)
    for codes, reference in ((m_codes, cpu[1]), (v_codes, cpu[3])):
        moved = (codes.int() - reference.int()).abs()
        assert moved.max() <= 1 and (moved > 0).float().mean() < 1e-3


def test_muon_runs_and_heads_on_cuda_equal_separate_matrices() -> None:
    """Matrices viewing one CUDA storage (one run) and per-head groups: the same bits as
    separate copies of them, whose heads are batched the same way."""
    gen = torch.Generator().manual_seed(0)
    storage = torch.randn(8 * 64 * 32, generator=gen).cuda()
    views = [torch.nn.Parameter(storage[i * 2048 : (i + 1) * 2048].view(64, 32)) for i in range(8)]
    copies = [torch.nn.Parameter(v.detach().clone()) for v in views]
    groups = lambda ps: [{"params": ps[:4]}, {"params": ps[4:], "num_heads": 4}]  # noqa: E731
    ours, theirs = Muon(groups(views), weight_decay=0.1), Muon(groups(copies), weight_decay=0.1)
    for _ in range(3):
        grads = torch.randn(8 * 64 * 32, generator=gen).cuda()
        for i, (view, copy) in enumerate(zip(views, copies, strict=True)):
            view.grad = grads[i * 2048 : (i + 1) * 2048].view(64, 32)
            copy.grad = view.grad.clone()
        ours.step()
        theirs.step()
        for view, copy in zip(views, copies, strict=True):
            assert torch.equal(view.detach(), copy.detach())
