"""AdamW8bit in one process: against fp32 AdamW, state size, policies, errors (anchors 13-15)."""

import copy

import pytest
import torch

from ragged_optimizers import AdamW8bit, dequantize


def _pair(shape, seed=0, dtype=torch.float32):
    p = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    return torch.nn.Parameter(p.to(dtype)), torch.nn.Parameter(p.clone())


def test_first_step_is_adamw_rounded_once_per_op() -> None:
    # The first step uses the unquantized moments, so it is AdamW's: each of our float32 ops
    # is one IEEE operation (torch's CPU AdamW contracts some into FMAs and its sqrt is not
    # correctly rounded), so we compare with float64 AdamW, to a few float32 roundings of the
    # parameter and of the step, and with torch's float32 AdamW on almost every element.
    ours, fp32 = _pair((96, 70))
    fp64 = torch.nn.Parameter(fp32.detach().double())
    opts = [AdamW8bit([ours]), torch.optim.AdamW([fp32]), torch.optim.AdamW([fp64])]
    start = fp64.detach().clone()
    ours.grad = fp32.grad = torch.randn(96, 70, generator=torch.Generator().manual_seed(7)) * 0.01
    fp64.grad = fp32.grad.double()
    for opt in opts:
        opt.step()
    lr = opts[0].param_groups[0]["lr"]
    # A few roundings of the decayed parameter (|p| scale) and of the step (lr scale): where the
    # two nearly cancel, the result's own size says nothing about its error.
    bound = 4 * 2**-24 * (start.abs() + lr)
    assert ((ours.double() - fp64).abs() <= bound).all()
    assert (ours != fp32).float().mean() < 0.01


@pytest.mark.parametrize("shape", [(1024, 32), (1024, 1024), (100, 70)])
def test_50_steps_track_fp32_adamw_within_bitsandbytes_thresholds(shape) -> None:
    # As bitsandbytes tests it: after each step compare, then put the reference at our
    # (dequantized) state so that the errors measured are one step's, not a random walk.
    ours, ref = _pair(shape)
    opt, ref_opt = AdamW8bit([ours]), torch.optim.AdamW([ref], foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        ours.grad = ref.grad = torch.randn(shape, generator=gen) * 0.01
        opt.step()
        ref_opt.step()
        err = (ours - ref).abs()
        assert err.mean() < 6e-5 and (err / (ref.abs() + 1e-9)).mean() < 6e-4
        state, ref_state = opt.state[ours], ref_opt.state[ref]
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            got = dequantize(state[key], state[f"{key}_scale"], (32, 32), signed=signed)
            close = torch.isclose(got, ref_state[key], atol=3e-3, rtol=1e-3)
            assert (~close).sum() <= 20
            ref_state[key].copy_(got)
        with torch.no_grad():
            ref.copy_(ours)


def test_state_bytes_per_parameter() -> None:
    param = torch.nn.Parameter(torch.zeros(1024, 1024))
    opt = AdamW8bit([param])
    param.grad = torch.ones_like(param)
    opt.step()
    state = opt.state[param]
    nbytes = sum(t.nbytes for k, t in state.items() if k != "step")
    assert nbytes == 2 * 1024 * 1024 + 2 * 4 * 32 * 32  # codes + one fp32 scale per block
    assert abs(nbytes / param.numel() - 2.0078) < 1e-4
    fp32 = torch.optim.AdamW([param])
    fp32.step()
    fp32_bytes = sum(t.nbytes for k, t in fp32.state[param].items() if k != "step")
    assert nbytes / fp32_bytes < 0.26


def test_small_and_non_2d_parameters_keep_fp32_state() -> None:
    shapes = [(63, 64), (4096,), (2, 64, 64), (64, 64)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    dtypes = [opt.state[p]["exp_avg"].dtype for p in params]
    assert dtypes == [torch.float32, torch.float32, torch.float32, torch.uint8]


def test_non_finite_gradients_skip_the_element_and_reset_its_state() -> None:
    ours, _ = _pair((64, 64))
    opt = AdamW8bit([ours], weight_decay=0.1)
    ours.grad = torch.full((64, 64), 0.01)
    opt.step()
    before = ours.detach().clone()
    grad = torch.full((64, 64), 0.01)
    grad[0, 0], grad[5, 7] = float("nan"), float("-inf")
    ours.grad = grad
    opt.step()
    assert ours[0, 0] == before[0, 0] and ours[5, 7] == before[5, 7]
    others = torch.ones(64, 64, dtype=torch.bool)
    others[0, 0] = others[5, 7] = False
    assert torch.all(ours.detach()[others] != before[others])
    state = opt.state[ours]
    m = dequantize(state["exp_avg"], state["exp_avg_scale"], (32, 32), signed=True)
    assert m[0, 0] == 0 and m[5, 7] == 0 and m[1, 1] != 0
    assert not ours.isnan().any()


def test_bf16_parameters_update_in_fp32_and_store_bf16() -> None:
    ours, _ = _pair((64, 64), dtype=torch.bfloat16)
    start = ours.detach().float()
    opt = AdamW8bit([ours], lr=0.1)
    ours.grad = torch.ones(64, 64, dtype=torch.bfloat16)
    opt.step()
    assert ours.dtype == torch.bfloat16  # the first step moves every element by lr
    expected = start * (1 - 0.1 * 0.01) - 0.1
    assert torch.all((ours.detach().float() - expected).abs() <= expected.abs() * 2**-7)  # 1 ulp


def test_clip_grad_norm_scheduler_and_state_dict_round_trip() -> None:
    model = torch.nn.Linear(128, 64)
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 128, generator=gen) for _ in range(4)]

    def train(m, o, s, batches):
        for x in batches:
            o.zero_grad()
            m(x).square().sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            s.step()

    train(model, opt, sched, inputs[:2])
    assert opt.param_groups[0]["lr"] == 2.5e-3  # the scheduler drives the step
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # as saving it would
    twin = torch.nn.Linear(128, 64)
    twin.load_state_dict(saved_model)
    twin_opt = AdamW8bit(twin.parameters(), lr=1e-2)
    twin_sched = torch.optim.lr_scheduler.StepLR(twin_opt, step_size=1, gamma=0.5)
    twin_opt.load_state_dict(saved_opt)
    twin_sched.load_state_dict(sched.state_dict())
    for key, value in opt.state[model.weight].items():  # codes stay uint8, scales fp32
        assert twin_opt.state[twin.weight][key].dtype == value.dtype, key
    train(model, opt, sched, inputs[2:])
    train(twin, twin_opt, twin_sched, inputs[2:])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_keeps_state_dtypes_for_bf16_parameters() -> None:
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in [(64, 64), (8,)]]
    opt = AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    twin = AdamW8bit(params)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in params:
        for key, value in opt.state[p].items():
            assert twin.state[p][key].dtype == value.dtype, key
            assert torch.equal(twin.state[p][key], value)


def test_bad_input() -> None:
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match=r"Invalid learning rate: -0\.1"):
        AdamW8bit(p, lr=-0.1)
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1\.0"):
        AdamW8bit(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="block_size must be a pair of ints >= 1"):
        AdamW8bit(p, block_size=(32, 0))
    with pytest.raises(ValueError, match="min_8bit_numel must be an int"):
        AdamW8bit(p, min_8bit_numel=1.5)
    with pytest.raises(ValueError, match=r"min_8bit_numel must be an int >= 0 .*got -5"):
        AdamW8bit(p, min_8bit_numel=-5)


# Parameters viewing one storage, as a DBuffer's shard holds them: 8-bit ones of 64 columns
# (the (40, 64) one ends with a partial block of rows, so its run ends there), one of 96
# columns, a 1-D one with fp32 state, and padding before the last.
SHARED = [(64, 64), (32, 64), (40, 64), (64, 64), (32, 96), (70,), (64, 64)]
SHARED_GAPS = [0, 0, 0, 0, 0, 0, 3]


def _shared(seed: int) -> tuple[torch.Tensor, list[torch.nn.Parameter], list[torch.Tensor]]:
    sizes = [torch.Size(s).numel() for s in SHARED]
    total = sum(sizes) + sum(SHARED_GAPS)
    storage = torch.randn(total, generator=torch.Generator().manual_seed(seed)) * 0.1
    grad_storage = torch.zeros(total)
    params, grads, at = [], [], 0
    for shape, size, gap in zip(SHARED, sizes, SHARED_GAPS, strict=True):
        at += gap
        params.append(torch.nn.Parameter(storage[at : at + size].view(shape)))
        grads.append(grad_storage[at : at + size].view(shape))
        at += size
    return storage, params, grads


class _Counting:
    """Counts the 8-bit kernel's calls."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


def test_runs_of_whole_blocks_step_as_one_tensor_bitwise() -> None:
    """Adjacent 8-bit pieces with whole blocks step in one kernel call per run, with the bits
    of each parameter stepped alone (copies in storages of their own)."""
    storage, shared, grad_views = _shared(0)
    alone = [torch.nn.Parameter(p.detach().clone()) for p in shared]
    runs_opt = AdamW8bit(shared, min_8bit_numel=1024, fused=False)
    alone_opt = AdamW8bit(alone, min_8bit_numel=1024, fused=False)
    runs_opt._kernel = _Counting(runs_opt._kernel)
    alone_opt._kernel = _Counting(alone_opt._kernel)
    padding = storage[-(SHARED_GAPS[-1] + 64 * 64) : -(64 * 64)].clone()
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        for param, view, copy_ in zip(shared, grad_views, alone, strict=True):
            grad = torch.randn(param.shape, generator=gen) * 0.01
            if step == 2 and param.shape == (32, 96):
                param.grad = copy_.grad = None  # no gradient: its count lags from here on
                continue
            view.copy_(grad)
            param.grad, copy_.grad = view, grad.clone()
        runs_opt.step()
        alone_opt.step()
        for i, (a, b) in enumerate(zip(shared, alone, strict=True)):
            assert torch.equal(a, b), (step, i)
            for key, value in alone_opt.state[b].items():
                assert torch.equal(runs_opt.state[a][key], value), (step, i, key)
    assert torch.equal(storage[-(SHARED_GAPS[-1] + 64 * 64) : -(64 * 64)], padding)
    # Runs: [(64, 64), (32, 64), (40, 64)] (the 40-row piece ends it), [(64, 64)], [(32, 96)]
    # and [(64, 64)] after the padding; the 1-D one steps with fp32 state.
    assert alone_opt._kernel.calls == 4 * 6 - 1
    assert runs_opt._kernel.calls == 4 * 4 - 1
    assert runs_opt.state[shared[0]]["exp_avg"].dtype == torch.uint8
    assert runs_opt.state[shared[5]]["exp_avg"].dtype == torch.float32


def test_state_dict_of_runs_loads_into_parameters_stepped_alone() -> None:
    _, shared, grad_views = _shared(2)
    alone = [torch.nn.Parameter(p.detach().clone()) for p in shared]
    runs_opt = AdamW8bit(shared, min_8bit_numel=1024, fused=False)
    for param, view in zip(shared, grad_views, strict=True):
        view.normal_(generator=torch.Generator().manual_seed(3))
        param.grad = view
    runs_opt.step()
    alone_opt = AdamW8bit(alone, min_8bit_numel=1024, fused=False)
    alone_opt.load_state_dict(runs_opt.state_dict())
    back = AdamW8bit(shared, min_8bit_numel=1024, fused=False)
    back.load_state_dict(alone_opt.state_dict())
    for a, b in zip(shared, alone, strict=True):
        for key, value in runs_opt.state[a].items():
            assert torch.equal(alone_opt.state[b][key], value), key
            assert torch.equal(back.state[a][key], value), key
    broken = runs_opt.state_dict()
    broken["state"][0]["exp_avg_scale"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"'exp_avg_scale' of params\[0\] has local shape \(6,\)"):
        AdamW8bit(shared, min_8bit_numel=1024).load_state_dict(broken)
