"""ragged_optimizers.AdamW on one process: torch.optim.AdamW's results, bit for bit.

The parameters here view one storage with padding between some of them (as a DBuffer's
shard does); their gradients view another. The reference is torch.optim.AdamW on
independent copies. Distributed: tests/test_optimizers_with_engine.py.
"""

from __future__ import annotations

import collections
import copy as copying
import cProfile
import io
import pickle
import pstats

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ragged_optimizers import AdamW

SHAPES = [(4, 3), (0, 3), (5,), (2, 2), (3, 1), (7,)]
GAPS = [0, 0, 0, 2, 0, 1]  # padding before each parameter


class Shared:
    """Parameters (and gradients) that view one storage each, with `GAPS` of padding."""

    def __init__(self, shapes: list[tuple[int, ...]], gaps: list[int], seed: int) -> None:
        sizes = [torch.Size(s).numel() for s in shapes]
        total = sum(sizes) + sum(gaps)
        gen = torch.Generator().manual_seed(seed)
        self.storage = torch.randn(total, generator=gen)
        self.grad_storage = torch.zeros(total)
        self.params, self.grad_views, self.padding = [], [], []
        at = 0
        for shape, size, gap in zip(shapes, sizes, gaps, strict=True):
            self.padding.extend(range(at, at + gap))
            at += gap
            self.params.append(nn.Parameter(self.storage[at : at + size].view(shape)))
            self.grad_views.append(self.grad_storage[at : at + size].view(shape))
            at += size
        self.padding_values = self.storage[self.padding].clone()

    def copies(self) -> list[nn.Parameter]:
        return [nn.Parameter(p.detach().clone()) for p in self.params]

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        for param, view, grad in zip(self.params, self.grad_views, grads, strict=True):
            if grad is None:
                param.grad = None
            else:
                view.copy_(grad)
                param.grad = view


def _grads(shapes, step: int, skip: frozenset[int] = frozenset()) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return [None if i in skip else g for i, g in enumerate(grads)]


# torch's fused CPU kernel runs a vector body and a scalar tail, whose roundings differ (a
# fused multiply-add in one, not the other); which elements fall in the tail depends on where
# a tensor starts, and a run starts elsewhere than its parameters. Measured: within 3 x fp32's
# eps relative after 20 steps (each step rounds once differently; the moments carry it on).
FUSED_TOLERANCE = {"rtol": 4 * torch.finfo(torch.float32).eps, "atol": 1e-12}


def _assert_same(ours: AdamW, torchs: torch.optim.AdamW, mine, theirs) -> None:
    fused = bool(torchs.param_groups[0]["fused"])
    for i, (p, q) in enumerate(zip(mine, theirs, strict=True)):
        assert sorted(ours.state[p]) == sorted(torchs.state[q]), i
        pairs = [(p, q, "param"), *((ours.state[p][k], v, k) for k, v in torchs.state[q].items())]
        for a, b, what in pairs:
            if fused:
                torch.testing.assert_close(a, b, **FUSED_TOLERANCE, msg=f"{i} {what}")
            else:
                assert torch.equal(a, b), (i, what)


def _train(kwargs: dict, groups_of, steps: int = 5, skips=None, replace_at=None) -> None:
    shared = Shared(SHAPES, GAPS, seed=0)
    theirs = shared.copies()
    ours = AdamW(groups_of(shared.params), **kwargs)
    torchs = torch.optim.AdamW(groups_of(theirs), **{"foreach": True, **kwargs})
    for step in range(steps):
        skip = (skips or {}).get(step, frozenset())
        grads = _grads(SHAPES, step, skip)
        shared.set_grads(grads)
        if replace_at is not None and step == replace_at:  # a user's own gradient tensor
            shared.params[3].grad = grads[3].clone()
        for q, g in zip(theirs, grads, strict=True):
            q.grad = None if g is None else g.clone()
        ours.step()
        torchs.step()
        _assert_same(ours, torchs, shared.params, theirs)
        assert torch.equal(shared.storage[shared.padding], shared.padding_values), "padding"


def _step_both(shared: Shared, theirs, ours, torchs, step: int) -> None:
    """One step of both optimizers on the same gradients (ours' in the shared storage)."""
    grads = _grads(SHAPES, step)
    shared.set_grads(grads)
    for q, g in zip(theirs, grads, strict=True):
        q.grad = g.clone()
    ours.step()
    torchs.step()


def _one_group(params):
    return params


def _interleaved_groups(params):
    """Weight decay on every other parameter: the groups' runs interleave in the storage."""
    return [
        {"params": params[0::2], "weight_decay": 0.1},
        {"params": params[1::2], "weight_decay": 0.0, "lr": 3e-3},
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 1e-2},
        {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.0},
        {"lr": 1e-2, "maximize": True, "betas": (0.8, 0.99), "eps": 1e-6},
        {"lr": 1e-2, "fused": True, "foreach": False},
        {"lr": 1e-2, "fused": True, "foreach": False, "amsgrad": True},
    ],
    ids=["plain", "amsgrad", "maximize", "fused", "fused-amsgrad"],
)
@pytest.mark.parametrize("groups_of", [_one_group, _interleaved_groups], ids=["one", "two"])
def test_equals_torch_adamw_bitwise(kwargs, groups_of) -> None:
    _train(kwargs, groups_of)


def test_missing_and_replaced_gradients_step_alone() -> None:
    # Parameter 2 has no gradient at step 1 (its step count then lags the others'), 4 none
    # at steps 2 and 3; at step 3 parameter 3's gradient is a tensor of the user's own.
    skips = {1: frozenset({2}), 2: frozenset({4}), 3: frozenset({4})}
    _train({"lr": 1e-2, "amsgrad": True}, _interleaved_groups, steps=6, skips=skips, replace_at=3)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_long_cpu_runs_step_in_chunks_in_place(monkeypatch, amsgrad) -> None:
    # 5 elements a chunk: the runs (up to 12 elements, padding inside) split mid-parameter.
    import ragged_optimizers._flat_adamw as flat

    calls = []
    real = flat._cpu_chunks
    monkeypatch.setattr(flat, "_CPU_FOREACH_CHUNK", 5)
    monkeypatch.setattr(flat, "_cpu_chunks", lambda *a: calls.append(real(*a)) or calls[-1])
    _train({"lr": 1e-2, "amsgrad": amsgrad}, _one_group)
    operands, counts = calls[-1]
    assert max(ops[0].numel() for ops in operands) == 5 and len(operands) > 6
    assert len(counts) == len(operands)


def test_lr_scheduler_drives_it() -> None:
    shared = Shared(SHAPES, GAPS, seed=1)
    theirs = shared.copies()
    ours, torchs = AdamW(shared.params, lr=0.1), torch.optim.AdamW(theirs, lr=0.1, foreach=True)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ours, torchs)]
    for step in range(4):
        grads = _grads(SHAPES, step)
        shared.set_grads(grads)
        for q, g in zip(theirs, grads, strict=True):
            q.grad = g.clone()
        for opt, schedule in zip((ours, torchs), schedules, strict=True):
            opt.step()
            schedule.step()
        _assert_same(ours, torchs, shared.params, theirs)
    assert ours.param_groups[0]["lr"] == 0.1 * 0.5**4


def test_state_dicts_cross_load_with_torch() -> None:
    shared = Shared(SHAPES, GAPS, seed=2)
    theirs = shared.copies()
    ours = AdamW(_interleaved_groups(shared.params), lr=1e-2, amsgrad=True)
    torchs = torch.optim.AdamW(_interleaved_groups(theirs), lr=1e-2, amsgrad=True, foreach=True)
    for step in range(2):
        grads = _grads(SHAPES, step, frozenset({1}) if step else frozenset())
        shared.set_grads(grads)
        for q, g in zip(theirs, grads, strict=True):
            q.grad = None if g is None else g.clone()
        ours.step()
        torchs.step()
    # Swap: torch's AdamW continues from ours' state dict, ours from torch's.
    from_ours = torch.optim.AdamW(_interleaved_groups(theirs), lr=1.0, foreach=True)
    from_ours.load_state_dict(ours.state_dict())
    from_torch = AdamW(_interleaved_groups(shared.params), lr=1.0)
    from_torch.load_state_dict(torchs.state_dict())
    for step in range(2, 4):
        _step_both(shared, theirs, from_torch, from_ours, step)
        _assert_same(from_torch, from_ours, shared.params, theirs)
    # What a checkpoint holds is each parameter's own state, without the padding.
    state = from_torch.state_dict()["state"]
    assert [tuple(state[i]["exp_avg"].shape) for i in range(len(SHAPES))] == [
        SHAPES[i] for i in [0, 2, 4, 1, 3, 5]
    ]


def _step_calls(num_params: int, make) -> int:
    shared = Shared([(3, 2)] * num_params, [0] * num_params, seed=3)
    opt = make(shared.params)
    for step in range(3):
        shared.set_grads(_grads([(3, 2)] * num_params, step))
        profiler = cProfile.Profile()
        profiler.enable()
        opt.step()
        profiler.disable()
    return pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]


def test_python_calls_per_step_do_not_grow_with_parameters() -> None:
    ours = [_step_calls(n, lambda ps: AdamW(ps, lr=1e-3)) for n in (16, 64)]
    theirs = [
        _step_calls(n, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)) for n in (16, 64)
    ]
    assert ours[0] == ours[1], ours
    assert theirs[1] > theirs[0] + 48, theirs  # the per-parameter path grows: the test can fail


def test_bad_input_names_the_value() -> None:
    params = Shared(SHAPES, GAPS, seed=4).params
    cases = [
        ({"lr": -1.0}, r"learning rate param_groups\[0\]\['lr'\]: -1.0"),
        ({"betas": (1.0, 0.9)}, r"beta parameter at index 0: 1.0"),
        ({"betas": (0.9,)}, r"must be a pair"),
        ({"eps": -1e-8}, r"epsilon value"),
        ({"weight_decay": -0.1}, r"weight_decay value"),
        ({"foreach": True, "fused": True}, r"cannot be set together"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            AdamW(params, **kwargs)
    with pytest.raises(NotImplementedError, match="capturable"):
        AdamW(params, capturable=True)
    opt = AdamW([("w", params[0]), ("b", params[2])], lr=1e-2)
    params[0].grad, params[2].grad = torch.ones(4, 3), torch.ones(5)
    opt.step()
    state = opt.state_dict()
    state["state"][1]["exp_avg"] = torch.zeros(6)
    with pytest.raises(ValueError, match=r"'exp_avg' of b has local shape \(6,\)"):
        AdamW([("w", params[0]), ("b", params[2])], lr=1e-2).load_state_dict(state)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.booleans()), min_size=1, max_size=8)
)
def test_any_layout_steps_as_torch(spec) -> None:
    """Any sizes, gaps and missing gradients: torch's results, padding untouched."""
    shapes = [(n,) for n, _, _ in spec]
    gaps = [gap for _, gap, _ in spec]
    shared = Shared(shapes, gaps, seed=5)
    theirs = shared.copies()
    ours = AdamW(shared.params, lr=1e-2, weight_decay=0.1)
    torchs = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(3):
        skip = frozenset(i for i, (_, _, absent) in enumerate(spec) if absent and step == 1)
        grads = _grads(shapes, step, skip)
        shared.set_grads(grads)
        for q, g in zip(theirs, grads, strict=True):
            q.grad = None if g is None else g.clone()
        ours.step()
        torchs.step()
        _assert_same(ours, torchs, shared.params, theirs)
        assert torch.equal(shared.storage[shared.padding], shared.padding_values)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_as_torch(set_to_none) -> None:
    shared = Shared(SHAPES, GAPS, seed=6)
    copies = shared.copies()
    ours = AdamW(shared.params, lr=1e-2)
    theirs = torch.optim.AdamW(copies, lr=1e-2, foreach=True)
    grads = _grads(SHAPES, 0, skip=frozenset({1}))
    shared.set_grads(grads)
    for copy, grad in zip(copies, grads, strict=True):
        copy.grad = None if grad is None else grad.clone()
    ours.zero_grad(set_to_none=set_to_none)
    theirs.zero_grad(set_to_none=set_to_none)
    for param, copy in zip(shared.params, copies, strict=True):
        if copy.grad is None:
            assert param.grad is None
        else:  # zeroed in place: still the view of the gradient storage
            assert param.grad is not None and not param.grad.any()
            assert param.grad.untyped_storage().data_ptr() == shared.grad_storage.data_ptr()
    assert set_to_none or shared.grad_storage.count_nonzero() == 0


def _moved(opt: torch.optim.Optimizer) -> None:
    """The usual loop that moves state (here onto the same device: a copy of each entry)."""
    for state in opt.state.values():
        for key, value in list(state.items()):
            state[key] = value.clone()


# What users do to an optimizer's state between steps. Each must be followed as torch's AdamW
# follows it: the next steps and state_dict() equal torch's.
STATE_EDITS = {
    "moved": lambda opt, ps: _moved(opt),
    "replaced scaled": lambda opt, ps: [
        st.__setitem__("exp_avg", st["exp_avg"] * 0.5) for st in opt.state.values()
    ],
    "in place": lambda opt, ps: [st["exp_avg_sq"].mul_(2.0) for st in opt.state.values()],
    "cleared": lambda opt, ps: opt.state.clear(),
    "one deleted": lambda opt, ps: opt.state.__delitem__(ps[2]),
    "one cleared": lambda opt, ps: opt.state[ps[0]].clear(),
    "one popped": lambda opt, ps: opt.state.pop(ps[5]),
    "one reassigned": lambda opt, ps: opt.state.__setitem__(
        ps[3], {k: v * 2 if k != "step" else v for k, v in opt.state[ps[3]].items()}
    ),
    "step replaced": lambda opt, ps: opt.state[ps[4]].update(step=torch.tensor(10.0)),
    "new state dict": lambda opt, ps: setattr(opt, "state", collections.defaultdict(dict)),
}


@pytest.mark.parametrize("edit", list(STATE_EDITS))
def test_user_edits_of_state_are_followed_as_torch_adamw(edit: str) -> None:
    shared = Shared(SHAPES, GAPS, seed=5)
    theirs = shared.copies()
    ours = AdamW(shared.params, lr=1e-2)
    torchs = torch.optim.AdamW(theirs, lr=1e-2, foreach=True)
    for step in range(6):
        if step == 3:
            STATE_EDITS[edit](ours, shared.params)
            STATE_EDITS[edit](torchs, theirs)
        _step_both(shared, theirs, ours, torchs, step)
        _assert_same(ours, torchs, shared.params, theirs)
        ours_sd, torch_sd = ours.state_dict(), torchs.state_dict()
        # torch's keeps insertion order; ours the parameters' (the same on every rank).
        assert list(ours_sd["state"]) == sorted(torch_sd["state"]), (edit, step)
        for index, state in torch_sd["state"].items():
            for key, value in state.items():
                assert torch.equal(ours_sd["state"][index][key], value), (edit, step, index, key)


def test_a_state_entry_without_a_moment_is_refused_by_name() -> None:
    shared = Shared(SHAPES, GAPS, seed=6)
    opt = AdamW([("w", shared.params[0]), ("b", shared.params[2])], lr=1e-2)
    shared.set_grads(_grads(SHAPES, 0))
    opt.step()
    del opt.state[shared.params[2]]["exp_avg_sq"]  # torch's AdamW: a KeyError at its step
    with pytest.raises(ValueError, match=r"the state of b has no 'exp_avg_sq'"):
        opt.step()


def test_state_is_in_parameter_order_and_pickles_as_torch_state() -> None:
    shared = Shared(SHAPES, GAPS, seed=7)
    # Listed against storage order: the runs are made (and their state filled) in storage
    # order, the state must still follow the parameters.
    params = shared.params[::-1]
    opt = AdamW(params, lr=1e-2)
    shared.set_grads(_grads(SHAPES, 0))
    opt.step()
    assert list(opt.state) == params
    assert list(opt.state_dict()["state"]) == list(range(len(params)))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    loaded = torch.load(saved)  # weights_only: plain dicts of tensors, as torch's AdamW saves
    assert all(type(entry) is dict for entry in loaded["state"].values())
    copied = copying.deepcopy(opt.state)
    assert type(copied) is collections.defaultdict, type(copied)
    first = next(iter(copied.values()))  # keyed by copies of the parameters
    assert torch.equal(first["exp_avg"], opt.state[params[0]]["exp_avg"])
    assert pickle.loads(pickle.dumps(opt.state_dict()))["state"].keys() == loaded["state"].keys()


def test_tensor_lr_steps_as_torch_without_foreach() -> None:
    shared = Shared(SHAPES, GAPS, seed=8)
    theirs = shared.copies()
    ours = AdamW(shared.params, lr=torch.tensor(0.01))
    torchs = torch.optim.AdamW(theirs, lr=torch.tensor(0.01))  # torch: foreach off
    for step in range(3):
        _step_both(shared, theirs, ours, torchs, step)
        _assert_same(ours, torchs, shared.params, theirs)
    with pytest.raises(ValueError, match=r"param_groups\[0\] has a tensor lr and foreach=True"):
        AdamW(shared.params, lr=torch.tensor(0.01), foreach=True)
