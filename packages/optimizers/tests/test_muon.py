"""Muon in one process: torch.optim.Muon where the formulas coincide, shapes, groups, errors."""

import copy
import math

import pytest
import torch

from ragged_optimizers import Muon, newton_schulz, resolve_coefficients


def _twins(shape, seed=0):
    p = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter(p), torch.nn.Parameter(p.clone())


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (7, 7)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_equals_torch_muon_bitwise(shape, nesterov, adjust_lr) -> None:
    # Same formulas: Keller coefficients, EMA momentum, decoupled weight decay, 2-D.
    ours, ref = _twins(shape)
    kw = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "momentum": 0.9}
    opt = Muon([ours], adjust_lr=adjust_lr, **kw)
    ref_opt = torch.optim.Muon([ref], adjust_lr_fn=adjust_lr, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ours.grad = ref.grad = torch.randn(shape, generator=gen)
        opt.step()
        ref_opt.step()
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("ns_batch_numel", [2**22, 1])
def test_stacks_are_batches_and_convs_are_flattened(ns_batch_numel) -> None:
    gen = torch.Generator().manual_seed(2)
    stack = torch.nn.Parameter(torch.randn(3, 12, 8, generator=gen))
    singles = [torch.nn.Parameter(stack[i].detach().clone()) for i in range(3)]
    conv = torch.nn.Parameter(torch.randn(8, 3, 2, 2, generator=gen))
    flat = torch.nn.Parameter(conv.detach().reshape(8, 12).clone())
    opt = Muon([stack, conv])
    ref = Muon([*singles, flat], ns_batch_numel=ns_batch_numel)
    for _ in range(2):
        g = torch.randn(3, 12, 8, generator=gen)
        gc = torch.randn(8, 3, 2, 2, generator=gen)
        stack.grad, conv.grad, flat.grad = g, gc, gc.reshape(8, 12).clone()
        for i, s in enumerate(singles):
            s.grad = g[i].clone()
        opt.step()
        ref.step()
    # Batched, the three same-shape matrices are exactly the stack; one at a time, bmm and
    # mm round differently: close. The conv is the same matrix.
    for i, s in enumerate(singles):
        if ns_batch_numel > 1:
            assert torch.equal(stack[i], s)
        assert (stack[i] - s).abs().max() < 1e-3
    assert torch.equal(conv.detach().reshape(8, 12), flat.detach())


def test_batches_follow_shape_order_and_element_budget() -> None:
    from ragged_optimizers._layout import layout_of
    from ragged_optimizers._muon_exchange import Item as _Item
    from ragged_optimizers._muon_exchange import make_units as _units

    shapes = [(4, 8), (8, 4), (4, 8), (4, 8), (2, 4, 8), (4, 8), (8, 4)]
    groups = [{}, {}]
    items = [
        _Item(p, str(i), layout_of(p), torch.empty(0), groups[i == 5])
        for i, p in enumerate(torch.nn.Parameter(torch.zeros(s)) for s in shapes)
    ]
    names = lambda units: [[item.name for item in u.items] for u in units]  # noqa: E731
    # 32 elements per matrix; the stack (2, 4, 8) and the other group's matrix go alone.
    assert names(_units(items, 64)) == [["0", "2"], ["1", "6"], ["3"], ["4"], ["5"]]
    assert names(_units(items, 95)) == [["0", "2"], ["1", "6"], ["3"], ["4"], ["5"]]
    assert names(_units(items, 96)) == [["0", "2", "3"], ["1", "6"], ["4"], ["5"]]
    assert names(_units(items, 2**22)) == [["0", "2", "3"], ["1", "6"], ["4"], ["5"]]
    for alone in (1, 63):  # no two fit
        assert names(_units(items, alone)) == [[str(i)] for i in range(7)]


def test_match_rms_adamw_gives_update_rms_about_0_2() -> None:
    p = torch.nn.Parameter(torch.zeros(256, 512))
    opt = Muon([p], lr=1.0, adjust_lr="match_rms_adamw", nesterov=False)
    p.grad = torch.randn(256, 512, generator=torch.Generator().manual_seed(3))
    opt.step()
    rms = p.detach().square().mean().sqrt().item()
    assert 0.15 < rms < 0.25, rms


def test_momentum_forms_give_the_same_orthogonalized_update() -> None:
    # EMA form (ours) vs sum form: the momenta differ by 1 / (1 - beta); NS removes the scale.
    gen = torch.Generator().manual_seed(4)
    ema, total, beta = torch.zeros(16, 32), torch.zeros(16, 32), 0.95
    for _ in range(4):
        g = torch.randn(16, 32, generator=gen)
        ema.lerp_(g, 1 - beta)
        total.mul_(beta).add_(g)
    steps, _ = resolve_coefficients("keller", 5)
    a, b = newton_schulz(ema, steps).float(), newton_schulz(total, steps).float()
    assert (a - b).abs().max() < 0.02


def test_adamw_groups_match_torch_adamw() -> None:
    gen = torch.Generator().manual_seed(5)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(10,), (32, 16)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = Muon(
        [{"params": ours, "use_muon": False}],
        adamw_lr=1e-2,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-10,
        adamw_weight_decay=0.1,
    )
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = b.grad = torch.randn(a.shape, generator=gen)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_zero_gradient_leaves_only_weight_decay() -> None:
    p = torch.nn.Parameter(torch.ones(8, 8))
    opt = Muon([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(8, 8)
    opt.step()
    assert torch.equal(p.detach(), torch.full((8, 8), 1 - 0.1 * 0.5))


def test_non_finite_gradient_poisons_the_matrix_as_documented() -> None:
    p = torch.nn.Parameter(torch.ones(8, 8))
    opt = Muon([p])
    grad = torch.ones(8, 8)
    grad[2, 3] = float("nan")
    p.grad = grad
    opt.step()
    assert p.isnan().all()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def test_clip_grad_norm_scheduler_and_state_dict_round_trip() -> None:
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        muon = [model[0].weight, model[1].weight]
        rest = [model[0].bias, model[1].bias]
        opt = Muon([{"params": muon}, {"params": rest, "use_muon": False}], lr=0.05)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))

    def train(model, opt, sched, seeds):
        for seed in seeds:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
            opt.zero_grad()
            model(x).square().sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

    model, opt, sched = make()
    train(model, opt, sched, [0, 1])
    assert math.isclose(opt.param_groups[0]["lr"], 0.05 / 3)
    assert math.isclose(opt.param_groups[1]["lr"], 3e-4 / 3)  # the AdamW group too
    twin, twin_opt, twin_sched = make()
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_sched.load_state_dict(sched.state_dict())
    train(model, opt, sched, [2, 3])
    train(twin, twin_opt, twin_sched, [2, 3])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_input() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"Muon group holds params\[1\] of shape \(4,\)"):
        Muon([w, torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="Muon group holds bias"):
        Muon([("weight", w), ("bias", torch.nn.Parameter(torch.zeros(4)))])
    with pytest.raises(ValueError, match="unknown ns_coefficients 'nope'"):
        Muon([w], ns_coefficients="nope")
    with pytest.raises(ValueError, match=r"Invalid lr: -1\.0"):
        Muon([w], lr=-1.0)
    with pytest.raises(ValueError, match="unknown adjust_lr 'spectral'"):
        Muon([w], adjust_lr="spectral")
    with pytest.raises(ValueError, match=r"Invalid momentum: 1\.0"):
        Muon([w], momentum=1.0)
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 0: -0\.1"):
        Muon([w], adamw_betas=(-0.1, 0.9))
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1"):
        Muon([w], bucket_bytes=0)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="ns_batch_numel must be an int >= 1"):
            Muon([w], ns_batch_numel=bad)


def test_same_shape_matrices_are_batched_only_while_every_owner_gets_one() -> None:
    from ragged_optimizers._layout import layout_of
    from ragged_optimizers._muon_exchange import Item, make_units

    params = [torch.nn.Parameter(torch.zeros(4, 8)) for _ in range(8)]
    group: dict = {}
    items = [Item(p, str(i), layout_of(p), torch.empty(0), group) for i, p in enumerate(params)]
    sizes = lambda owners: [len(u.items) for u in make_units(items, 2**22, owners)]  # noqa: E731
    assert sizes(1) == [8]  # one process: one batch
    assert sizes(4) == [2, 2, 2, 2]  # one unit per owner (the default batch put 8 on one)
    assert sizes(3) == [3, 3, 2]
    assert sizes(8) == [1] * 8 and sizes(16) == [1] * 8
    assert sizes(5) == [1] * 8  # batches of 2 would leave an owner idle: 4 units for 5
    # The element budget still caps a batch.
    assert [len(u.items) for u in make_units(items, 2 * 32, 1)] == [2, 2, 2, 2]


def test_per_head_equals_muon_on_each_head_as_its_own_matrix() -> None:
    """num_heads: the same update as the heads cut out as parameters, batched in one call."""
    from optimizer_cases import HEAD_SHAPES, PER_HEAD_GROUPS, muon_per_head

    from ragged_optimizers._per_head import join_heads, split_heads

    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, s in HEAD_SHAPES.items()}
    ours = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    opt = muon_per_head(ours)
    whole = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    whole_opt = Muon(list(whole.values()), lr=0.02, weight_decay=0.1)
    # The reference: each head a parameter; one Muon per matrix, whose heads form one batch.
    split = {g["names"][0]: (g.get("num_heads", 1), g.get("heads_dim", 0)) for g in PER_HEAD_GROUPS}
    heads = {
        n: [torch.nn.Parameter(h.clone()) for h in split_heads(full[n], *split[n])]
        for n in HEAD_SHAPES
    }
    head_opts = [Muon(hs, lr=0.02, weight_decay=0.1) for hs in heads.values()]
    for step in range(3):
        grads = {n: torch.randn(s, generator=gen) for n, s in HEAD_SHAPES.items()}
        for n, g in grads.items():
            ours[n].grad, whole[n].grad = g.clone(), g.clone()
            for head, head_grad in zip(heads[n], split_heads(g, *split[n]), strict=True):
                head.grad = head_grad.clone()
        for o in (opt, whole_opt, *head_opts):
            o.step()
        for n in HEAD_SHAPES:
            joined = join_heads(
                torch.stack([h.detach() for h in heads[n]]), full[n].shape, *split[n]
            )
            assert torch.equal(ours[n].detach(), joined), (n, step)
    # Per head is not per matrix (w1, a whole matrix in both, is the control).
    assert torch.equal(ours["w1"].detach(), whole["w1"].detach())
    for n in ("wq", "wo"):
        assert not torch.allclose(ours[n].detach(), whole[n].detach(), atol=1e-3), n


def test_per_head_bad_input_names_the_parameter() -> None:
    wq = torch.nn.Parameter(torch.zeros(60, 32))
    for group, match in [
        ({"num_heads": 8}, r"params\[0\] of shape \(60, 32\): dim 0 \(60\) does not split"),
        ({"num_heads": 0}, r"num_heads must be None or an int >= 1, got 0"),
        ({"num_heads": 2.0}, r"num_heads must be None or an int >= 1, got 2.0"),
        ({"num_heads": 4, "heads_dim": 2}, r"heads_dim must be 0 .* got 2"),
    ]:
        with pytest.raises(ValueError, match=match):
            Muon([{"params": [wq], **group}])
    conv = torch.nn.Parameter(torch.zeros(8, 4, 3, 3))
    with pytest.raises(ValueError, match=r"params\[0\] of shape \(8, 4, 3, 3\): per-head"):
        Muon([{"params": [conv], "num_heads": 2}])


def _one_storage(num_params: int, shape=(6, 4), seed=0):
    """Parameters viewing one storage (as fully_shard's do), their grads another, and copies."""
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    storage, grads = torch.randn(num_params * numel, generator=gen), torch.zeros(num_params * numel)
    views = [torch.nn.Parameter(storage[i * numel : (i + 1) * numel].view(shape))
             for i in range(num_params)]  # fmt: skip
    grad_views = [grads[i * numel : (i + 1) * numel].view(shape) for i in range(num_params)]
    return views, grad_views, [torch.nn.Parameter(p.detach().clone()) for p in views]


def _lerp_tensors(opt: Muon) -> int:
    """How many tensors the momentum's foreach lerp is handed in one step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        handed = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_foreach_lerp_" in str(func):
                Count.handed += len(args[0])
            return func(*args, **(kwargs or {}))

    with Count():
        opt.step()
    return Count.handed


def test_momentum_steps_runs_of_adjacent_pieces_as_one_tensor() -> None:
    """Views of one storage: one tensor per run for the momentum (16 or 64 matrices alike),
    bitwise the updates of separate matrices; edits and state dicts still followed."""
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "ns_batch_numel": 1}
    for num_params in (16, 64):
        views, grad_views, copies = _one_storage(num_params)
        ours, theirs = Muon(views, **kwargs), Muon(copies, **kwargs)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            for view, grad, copy_ in zip(views, grad_views, copies, strict=True):
                grad.copy_(torch.randn(grad.shape, generator=gen))
                view.grad, copy_.grad = grad, grad.clone()
            if step == 1:  # a missing gradient cuts the run for a step
                views[3].grad = copies[3].grad = None
            if step == 2:  # a user's edit: replaced, then followed
                for opt, params in ((ours, views), (theirs, copies)):
                    buf = opt.state[params[5]]["momentum_buffer"]
                    opt.state[params[5]]["momentum_buffer"] = buf * 0.5
            handed = (_lerp_tensors(ours), _lerp_tensors(theirs))
            if step in (0, 3):  # one run, against one tensor per matrix
                assert handed == (1, num_params), (step, handed)
            for view, copy_ in zip(views, copies, strict=True):
                assert torch.equal(view.detach(), copy_.detach()), step
                assert torch.equal(
                    ours.state[view]["momentum_buffer"], theirs.state[copy_]["momentum_buffer"]
                )
        # Every entry views the run's one momentum tensor; state dicts carry torch's format.
        pointers = {ours.state[v]["momentum_buffer"].untyped_storage().data_ptr() for v in views}
        assert len(pointers) == 1
        loaded = Muon(_one_storage(num_params)[0], **kwargs)
        loaded.load_state_dict(copy.deepcopy(ours.state_dict()))
        assert torch.equal(
            loaded.state_dict()["state"][7]["momentum_buffer"],
            ours.state_dict()["state"][7]["momentum_buffer"],
        )
