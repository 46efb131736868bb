"""Operations on RaggedShard DTensors against the same ops on the full tensor.

Autograd (through from_local too), elementwise and foreach ops (run on the locals where
they can be), reductions, views and factories, clip_grad_norm_, torch optimizers, random
fills.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from ragged_support import DTYPES, make_mesh, reference_tensor
from rank_pool import expect_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ragged_placement import (
    CommCounter,
    RaggedShard,
)


def check_autograd(shape: tuple[int, ...], units: tuple[int, ...]) -> None:
    mesh = make_mesh()
    full = reference_tensor(shape, seed=3)
    weights = reference_tensor(shape, seed=4)
    placement = RaggedShard((0,), units)
    x = distribute_tensor(full, mesh, [placement], src_data_rank=None).requires_grad_()
    y = x.full_tensor()
    loss = (y * weights).sum()
    with CommCounter() as comms:
        loss.backward()
    # Replicate -> RaggedShard for the gradient is a local slice: nothing is sent.
    assert comms.collectives == [], comms.collectives
    assert x.grad is not None and x.grad.placements == (placement,)
    assert torch.equal(x.grad.full_tensor(), weights)

    z = distribute_tensor(full, mesh, [placement], src_data_rank=None).requires_grad_()
    other = RaggedShard((0,), tuple(reversed(units)))
    (z.redistribute(mesh, [other]).to_local() * 2).sum().backward()
    assert z.grad is not None and z.grad.placements == (placement,)
    assert torch.equal(z.grad.full_tensor(), torch.full_like(full, 2.0))


def check_from_local_autograd(shape: tuple[int, ...], units: tuple[int, ...]) -> int:
    """Autograd through `DTensor.from_local` of a RaggedShard (and into one), every pair.

    Returns the number of (source, target) pairs checked, so the caller can see none was skipped.
    """
    mesh = make_mesh()
    full = reference_tensor(shape, seed=7)
    weights = reference_tensor(shape, seed=8)
    ragged = RaggedShard((0,), units)
    reversed_ragged = RaggedShard((0,), tuple(reversed(units)))
    sources = [ragged, reversed_ragged, Shard(0)]
    targets = [Replicate(), Shard(0), ragged, reversed_ragged]
    checked = 0
    for source, target in itertools.product(sources, targets):
        if not any(isinstance(p, RaggedShard) for p in (source, target)):
            continue
        piece = distribute_tensor(full, mesh, [source], src_data_rank=None).to_local()
        local = piece.clone().requires_grad_()
        dt = DTensor.from_local(local, mesh, [source], shape=full.shape, stride=full.stride())
        out = dt.redistribute(mesh, [target]).full_tensor()
        torch.testing.assert_close(out, full)
        (out * weights).sum().backward()
        expected = distribute_tensor(weights, mesh, [source], src_data_rank=None).to_local()
        assert local.grad is not None, (source, target)
        pair = f"{source}->{target}"
        torch.testing.assert_close(local.grad, expected, msg=lambda m, pair=pair: f"{pair}: {m}")
        checked += 1
    # The reported failure: a whole-tensor sum of a RaggedShard DTensor made from a local piece.
    local = distribute_tensor(full, mesh, [ragged], src_data_rank=None).to_local()
    local = local.clone().requires_grad_()
    DTensor.from_local(local, mesh, [ragged], shape=full.shape).sum().full_tensor().backward()
    assert local.grad is not None
    torch.testing.assert_close(local.grad, torch.ones_like(local))
    return checked + 1


def check_elementwise(shape: tuple[int, ...], units: tuple[int, ...], dtype: str) -> None:
    mesh = make_mesh()
    a_full, b_full = reference_tensor(shape, dtype, 5), reference_tensor(shape, dtype, 6)
    placement = RaggedShard((0,), units)
    a = distribute_tensor(a_full, mesh, [placement], src_data_rank=None)
    b = distribute_tensor(b_full, mesh, [placement], src_data_rank=None)
    rep = distribute_tensor(b_full, mesh, [Replicate()], src_data_rank=None)
    scalar = distribute_tensor(torch.tensor(3.0, dtype=DTYPES[dtype]), mesh, [Replicate()])
    cases = {
        "a*2+1": (a * 2 + 1, a_full * 2 + 1),
        "a+b": (a + b, a_full + b_full),
        "a*rep": (a * rep, a_full * b_full),
        "a/scalar": (a / scalar, a_full / 3.0),
        "where": (torch.where(a > 0, a, b), torch.where(a_full > 0, a_full, b_full)),
        "sqrt(abs)": (a.abs().sqrt(), a_full.abs().sqrt()),
        "zeros_like": (torch.zeros_like(a), torch.zeros_like(a_full)),
        "to fp32": (a.to(torch.float32), a_full.to(torch.float32)),
    }
    for name, (got, want) in cases.items():
        assert got.placements == (placement,), (name, got.placements)
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.full_tensor(), want, msg=name)
    # In place on a Replicate tensor with a RaggedShard operand: the written tensor keeps its
    # spec (the operand is gathered), it is not silently replaced by a resharded copy.
    r = distribute_tensor(b_full.clone(), mesh, [Replicate()], src_data_rank=None)
    r.add_(a)
    assert r.placements == (Replicate(),)
    torch.testing.assert_close(r.to_local(), b_full + a_full)
    c = a.clone()
    c.mul_(b).add_(1.0)
    torch.testing.assert_close(c.full_tensor(), a_full * b_full + 1.0)
    outs = torch._foreach_add([a, b], [b, a])
    for out in outs:
        assert out.placements == (placement,)
        torch.testing.assert_close(out.full_tensor(), a_full + b_full)
    torch._foreach_mul_([c, a], 0.5)
    torch.testing.assert_close(a.full_tensor(), a_full * 0.5)
    # A broadcast operand: out of place, the operands are gathered (Replicate result); in
    # place, writing through the pieces cannot broadcast and raises.
    broadcast = distribute_tensor(b_full[0], mesh, [Replicate()])
    summed = a + broadcast
    assert summed.placements == (Replicate(),)
    torch.testing.assert_close(summed.full_tensor(), a.full_tensor() + b_full[0])
    expect_error(NotImplementedError, lambda: a.add_(broadcast), "cannot broadcast")


def check_reductions(shape: tuple[int, ...], units: tuple[int, ...]) -> None:
    mesh = make_mesh()
    full = reference_tensor(shape, seed=7)
    placement = RaggedShard((0,), units)
    dt = distribute_tensor(full, mesh, [placement], src_data_rank=None)
    torch.testing.assert_close(dt.sum().full_tensor(), full.sum())
    torch.testing.assert_close(dt.mean().full_tensor(), full.mean())
    for ord_ in (2, 1, 3.5):
        got = torch.linalg.vector_norm(dt, ord=ord_).full_tensor()
        torch.testing.assert_close(got, torch.linalg.vector_norm(full, ord=ord_))
    if all(units):  # max over an empty piece has no identity (torch raises)
        got = torch.linalg.vector_norm(dt, ord=math.inf).full_tensor()
        torch.testing.assert_close(got, full.abs().max())
    norms = torch._foreach_norm([dt, dt * 2])
    torch.testing.assert_close(norms[1].full_tensor(), torch.linalg.vector_norm(full * 2))


def check_reductions_along_dims(units: tuple[int, ...]) -> None:
    """Per-dim sum / mean / amax / amin / vector norms: gathered once, the result Replicate."""
    mesh = make_mesh()
    full = reference_tensor((2 * sum(units), 4, 3), seed=9)
    cases = {
        "norm dim 1": lambda t: torch.linalg.norm(t, dim=1),
        "norm dims 1, 2": lambda t: torch.linalg.vector_norm(t, ord=3, dim=(1, 2)),
        "sum dim -1": lambda t: t.sum(-1),
        "mean keepdim": lambda t: t.mean(dim=2, keepdim=True),
        "amax dim 2": lambda t: t.amax(2),
        "amin dims 0, 2": lambda t: t.amin((0, 2)),
        "sum dim 0": lambda t: t.sum(0),
    }
    for cut in ((0,), (0, 1)):
        dt = distribute_tensor(full, mesh, [RaggedShard(cut, units)], src_data_rank=None)
        for name, fn in cases.items():
            got = fn(dt)
            assert got.placements == (Replicate(),), (name, cut, got.placements)
            torch.testing.assert_close(got.to_local(), fn(full), msg=f"{name}, cut {cut}")
    # Autograd through both: the norm's backward broadcasts its result against the input,
    # which gathers (its gradient is Replicate); an optimizer then steps the pieces.
    dt = distribute_tensor(full, mesh, [RaggedShard((0,), units)], src_data_rank=None)
    dt.requires_grad_()
    (dt.sum(-1) * 2).sum().backward()
    torch.testing.assert_close(dt.grad.full_tensor(), torch.full_like(full, 2.0))
    dt.grad = None
    ref = full.clone().requires_grad_()
    torch.linalg.norm(ref, dim=1).pow(2).sum().backward()
    torch.linalg.norm(dt, dim=1).pow(2).sum().backward()
    torch.testing.assert_close(dt.grad.full_tensor(), ref.grad)
    # An in-place op cannot gather what it writes: broadcasting into a piece is refused.
    expect_error(
        NotImplementedError,
        lambda: dt.detach().mul_(torch.linalg.norm(dt, dim=1).detach().unsqueeze(1)),
        "cannot broadcast an operand of shape",
    )


def check_views_factories_and_gathered_ops(units: tuple[int, ...]) -> None:
    """Views keep the RaggedShard (aliasing the local piece); new_* is Replicate; cat gathers."""
    mesh = make_mesh()
    rows = 2 * sum(units)
    full = reference_tensor((rows, 6), seed=11)
    dt = distribute_tensor(full, mesh, [RaggedShard((0,), units)], src_data_rank=None)
    views = {
        "view (rows, 3, 2)": (lambda t: t.view(rows, 3, 2), (0,)),
        "reshape (2 rows, 3)": (lambda t: t.reshape(2 * rows, 3), (0,)),
        "flatten": (lambda t: t.flatten(), (0,)),
        # Each unit is 2 rows (12 elements): whole rows of (rows / 2, 6) only if rows <= 4.
        "unflatten(0, (2, rows / 2))": (
            lambda t: t.unflatten(0, (2, rows // 2)),
            (0,) if 12 % (rows // 2 * 6) == 0 else (0, 1),
        ),
    }
    for name, (fn, cut) in views.items():
        got = fn(dt)
        assert got.placements == (RaggedShard(cut, units),), (name, got.placements)
        assert got.to_local().data_ptr() == dt.to_local().data_ptr(), name  # an alias
        torch.testing.assert_close(got.full_tensor(), fn(full), msg=name)
    with torch.no_grad():  # a write through a view reaches the tensor
        dt.view(-1).mul_(2)
    torch.testing.assert_close(dt.full_tensor(), full * 2)
    # Autograd through a view (the view's backward is a view of the gradient).
    leaf = torch.nn.Parameter(dt.detach().clone())
    (leaf.view(rows, 3, 2) * leaf.view(rows, 3, 2)).sum().backward()
    assert leaf.grad.placements == leaf.placements
    torch.testing.assert_close(leaf.grad.full_tensor(), 2 * leaf.detach().full_tensor())
    leaf.grad = None
    (leaf.view(rows, 3, 2) * 3).sum().backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), torch.full_like(full, 3.0))
    # The gradient-accumulator idiom (`p.view_as(p)`) is refused: split-backward pipeline
    # schedules would otherwise compute no gradient for a sharded parameter, silently. So are
    # views that cannot keep the pieces (a copy would drop what is written through it).
    expect_error(NotImplementedError, lambda: leaf.view_as(leaf), "identity view")
    for fn in (lambda t: t.t(), lambda t: t.unsqueeze(1)):
        expect_error(NotImplementedError, lambda f=fn: f(dt), "has no sharding rule")
    fresh = dt.new_empty(5, 3)
    assert fresh.placements == (Replicate(),) and fresh.shape == (5, 3)
    assert dt.new_zeros(4).full_tensor().count_nonzero() == 0
    for name, fn in {
        "cat": lambda t: torch.cat([t, t * 3], dim=1),
        "stack": lambda t: torch.stack([t, t]),
    }.items():
        got = fn(dt)
        assert got.placements == (Replicate(),), (name, got.placements)
        torch.testing.assert_close(got.full_tensor(), fn(full * 2), msg=name)


def check_clip_grad_norm(units: tuple[int, ...]) -> None:
    mesh = make_mesh()
    shapes = {"ragged": (12, 4), "shard": (9, 3), "rep": (5,)}
    placements = {"ragged": [RaggedShard((0,), units)], "shard": [Shard(0)], "rep": [Replicate()]}
    ref_params, params = [], []
    for i, (name, shape) in enumerate(shapes.items()):
        value, grad = reference_tensor(shape, seed=10 + i), reference_tensor(shape, seed=20 + i)
        ref = torch.nn.Parameter(value.clone())
        ref.grad = grad.clone()
        ref_params.append(ref)
        p = torch.nn.Parameter(distribute_tensor(value, mesh, placements[name], src_data_rank=None))
        p.grad = distribute_tensor(grad, mesh, placements[name], src_data_rank=None)
        params.append(p)
    for foreach in (False, True):
        ref_total = torch.nn.utils.clip_grad_norm_(ref_params, max_norm=0.5, foreach=foreach)
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=foreach)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        torch.testing.assert_close(total, ref_total)
        for p, ref in zip(params, ref_params, strict=True):
            assert p.grad is not None and ref.grad is not None
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad)


def check_optimizer(
    name: str, impl: str, units_a: tuple[int, ...], units_b: tuple[int, ...]
) -> None:
    """`impl`: "for-loop", "foreach" or "fused" (torch's fused kernels, run on the pieces).

    Fused kernels vectorize each piece on its own, so an element may take the vector or the
    scalar tail path in one process and the other here (6e-8 apart, fused SGD, measured).
    """
    mesh = make_mesh()
    shapes = [(4 * sum(units_a), 3), (2 * sum(units_b),)]
    placements = [RaggedShard((0,), units_a), RaggedShard((0,), units_b)]
    how: dict[str, Any] = {"foreach": impl == "foreach"}
    if impl == "fused":
        how = {"fused": True}
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **how),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, **how),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **how),
    }[name]
    ref = [torch.nn.Parameter(reference_tensor(s, seed=30 + i)) for i, s in enumerate(shapes)]
    dist_params = [
        torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [pl], src_data_rank=None))
        for p, pl in zip(ref, placements, strict=True)
    ]
    ref_opt, opt = make(ref), make(dist_params)
    for step in range(3):
        for i, (r, d) in enumerate(zip(ref, dist_params, strict=True)):
            grad = reference_tensor(r.shape, seed=100 * step + i)
            r.grad = grad.clone()
            d.grad = distribute_tensor(grad, mesh, [placements[i]], src_data_rank=None)
        ref_opt.step()
        opt.step()
    for r, d in zip(ref, dist_params, strict=True):
        assert d.placements[0] in placements
        torch.testing.assert_close(d.full_tensor(), r.detach())


def check_foreach_decisions(units: tuple[int, ...]) -> None:
    """Foreach ops decided entry by entry equal the decision for the whole list, and an
    optimizer whose parameters with a gradient change every step propagates nothing once it
    has seen each parameter (and equals one process)."""
    from ragged_placement._compat import _installed
    from ragged_placement._decisions import ShardingDecisions
    from ragged_placement._ops import propagate

    mesh = make_mesh()
    rows = sum(units)
    shapes = [(2 * rows, 3), (rows,), (3 * rows, 2, 2), (2 * rows, 3)]
    fulls = [reference_tensor(shape, seed=40 + i) for i, shape in enumerate(shapes)]
    ragged = [
        distribute_tensor(f, mesh, [RaggedShard((0,), units)], src_data_rank=None) for f in fulls
    ]
    others = [distribute_tensor(f * 2, mesh, [RaggedShard((0,), units)]) for f in fulls]
    replicated = [distribute_tensor(f, mesh, [Replicate()]) for f in fulls]
    scale = DTensor.from_local(torch.tensor(0.5), mesh, [Partial()])  # clip's coefficient
    aten = torch.ops.aten
    calls = [
        (aten._foreach_add_.List, (ragged, replicated), {"alpha": 2.0}),  # Replicate moves
        (aten._foreach_add.List, (ragged, others), {}),
        (aten._foreach_mul_.Tensor, (ragged, scale), {}),  # a Partial scalar moves
        (aten._foreach_norm.Scalar, (ragged, 2), {}),
        (aten._foreach_norm.Scalar, (ragged, math.inf), {}),
        (aten._foreach_lerp_.Scalar, (ragged, others, 0.1), {}),
        (aten._foreach_addcdiv_.ScalarList, (ragged, others, others, [0.1, 0.2, 0.3, 0.4]), {}),
        (aten._foreach_sqrt.default, (others,), {}),
    ]
    dispatcher = DTensor._op_dispatcher
    meta = dispatcher.sharding_propagator._propagate_tensor_meta_non_cached
    for op, args, kwargs in calls:
        schema = dispatcher.unwrap_to_op_info(op, args, kwargs).schema
        decisions = ShardingDecisions()
        joined = decisions.decide(schema, meta)
        whole = propagate(schema, meta)
        assert decisions.num_propagations == 3, (op, decisions.num_propagations)  # 3 shapes
        assert joined.output_spec == whole.output_spec, op
        assert joined.needs_redistribute == whole.needs_redistribute, op
        if whole.needs_redistribute:
            assert joined.redistribute_schema is not None and whole.redistribute_schema
            assert joined.redistribute_schema.args_spec == whole.redistribute_schema.args_spec
        # Another subset, in another order, of entries seen before: nothing to propagate.
        subset = [a[::-1][:2] if isinstance(a, list) and len(a) == 4 else a for a in args]
        schema = dispatcher.unwrap_to_op_info(op, tuple(subset), kwargs).schema
        assert decisions.decide(schema, meta).output_spec == propagate(schema, meta).output_spec
        assert decisions.num_propagations == 3, op
        # Decisions found by the entries' identity equal the propagated ones, also when the
        # identity table is cleared at every call (bounded to fewer entries than one list).
        small = ShardingDecisions(max_columns_by_id=1)
        for _ in range(3):
            assert small.decide(schema, meta).output_spec == propagate(schema, meta).output_spec
        assert small.num_propagations == 2, op  # the subset: 2 distinct shapes
    # AdamW + clip where a different subset of parameters has a gradient every step.
    refs = [torch.nn.Parameter(f.clone()) for f in fulls]
    params = [torch.nn.Parameter(r.detach().clone()) for r in ragged]
    make = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True)  # noqa: E731
    ref_opt, opt = make(refs), make(params)
    hooks = _installed[0]
    for step in range(6):
        used = [i for i in range(len(params)) if (i + step) % 3]  # a different subset
        for i in used:
            grad = reference_tensor(shapes[i], seed=200 + 10 * step + i)
            refs[i].grad = grad.clone()
            params[i].grad = distribute_tensor(grad, mesh, [RaggedShard((0,), units)])
        if step == 3:
            before = hooks.decisions.num_propagations  # type: ignore[attr-defined]
        for group, optimizer in ((refs, ref_opt), (params, opt)):
            torch.nn.utils.clip_grad_norm_(group, 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad()
    assert hooks.decisions.num_propagations == before  # type: ignore[attr-defined]
    for ref, param in zip(refs, params, strict=True):
        torch.testing.assert_close(param.full_tensor(), ref.detach())


def _full_tensors(arg: Any) -> Any:
    if isinstance(arg, DTensor):
        return arg.full_tensor()
    if isinstance(arg, list) and isinstance(arg[0], DTensor):
        return [t.full_tensor() for t in arg]
    return arg


def check_foreach_on_locals(units: tuple[int, ...]) -> None:
    """Elementwise foreach ops on RaggedShard lists of one layout per entry run on the local
    tensors (no DTensor dispatch per entry) and equal the ops on the full tensors; every
    other call goes through DTensor's dispatch and is right too."""
    from ragged_placement._compat import _patches

    mesh = make_mesh()
    rows = sum(units)
    other_units = tuple(reversed(units))
    shapes = [(2 * rows, 3), (rows,), (3 * rows, 2, 2)]

    def ragged(tag: int, scale: float = 1.0, layout: tuple[int, ...] = units) -> list[Any]:
        return [
            distribute_tensor(
                reference_tensor(shape, seed=tag + i) * scale, mesh, [RaggedShard((0,), layout)]
            )
            for i, shape in enumerate(shapes)
        ]

    fallbacks: list[object] = []
    dispatch = _patches.dispatch_without_handler

    def counting(op: Any, args: Any, kwargs: Any) -> object:
        fallbacks.append(op)
        return dispatch(op, args, kwargs)

    _patches.dispatch_without_handler = counting  # what the installed handlers call
    try:
        aten = torch.ops.aten
        pos = lambda tag: [d.abs() + 0.1 for d in ragged(tag)]  # noqa: E731
        replicated = DTensor.from_local(torch.tensor(0.25), mesh, [Replicate()])
        fast = [  # (op, args, kwargs): on the local tensors
            (aten._foreach_add_.List, (ragged(1), ragged(2)), {"alpha": 2.0}),
            (aten._foreach_add_.Scalar, (ragged(3), 0.5), {}),
            (aten._foreach_mul_.ScalarList, (ragged(4), [0.5, 2.0, -1.0]), {}),
            (aten._foreach_mul_.Tensor, (ragged(5), replicated), {}),
            (aten._foreach_lerp_.Scalar, (ragged(6), ragged(7), 0.1), {}),
            (aten._foreach_addcmul_.Scalar, (ragged(8), ragged(9), ragged(10)), {"value": 0.3}),
            (aten._foreach_addcdiv_.ScalarList, (ragged(11), ragged(12), pos(13), [1, 2, 3]), {}),
            (aten._foreach_div_.List, (ragged(14), pos(15)), {}),
            (aten._foreach_sqrt.default, (pos(16),), {}),
            (aten._foreach_add.List, (ragged(17), ragged(18)), {}),
            (aten._foreach_zero_.default, (ragged(19),), {}),
            (aten._foreach_norm.Scalar, (ragged(25), 2), {}),  # partial norms
            (aten._foreach_norm.Scalar, (ragged(26), math.inf), {}),
        ]
        full_copies = [r.redistribute(mesh, [Replicate()]) for r in ragged(21)]
        partial = DTensor.from_local(torch.tensor(0.5), mesh, [Partial()])
        slow = [  # DTensor's dispatch: a Replicate list, a Partial scalar, another layout
            (aten._foreach_add_.List, (ragged(20), full_copies), {}),
            (aten._foreach_mul_.Tensor, (ragged(22), partial), {}),
            (aten._foreach_add.List, (ragged(23), ragged(24, layout=other_units)), {}),
            (aten._foreach_norm.Scalar, (full_copies, 2), {}),
        ]
        for group, expect_fast in ((fast, True), (slow, False)):
            for op, args, kwargs in group:
                fulls = [_full_tensors(a) for a in args]
                expected = op(*fulls, **kwargs)
                before = len(fallbacks)
                got = op(*args, **kwargs)
                ran_fast = len(fallbacks) == before
                same_layout = op is aten._foreach_add.List and other_units == units
                assert ran_fast == (expect_fast or same_layout), (op, units)
                if got is None:  # in place
                    got, expected = args[0], fulls[0]
                assert all(isinstance(g, DTensor) for g in got), op
                for g, e in zip(got, expected, strict=True):
                    torch.testing.assert_close(g.full_tensor(), e, msg=str(op))
        # Autograd through the local path: d(sum(3 x + x))/dx = 4.
        leaves = [t.detach().requires_grad_() for t in ragged(27)]
        tripled = torch._foreach_mul(leaves, 3.0)
        summed = torch._foreach_add(tripled, leaves)
        sum(t.sum() for t in summed).backward()
        for leaf in leaves:
            torch.testing.assert_close(leaf.grad.full_tensor(), torch.full(leaf.shape, 4.0))
        # A dtype promotion out of place is DTensor's to decide, and it still is right.
        ints = [distribute_tensor(torch.arange(2 * rows), mesh, [RaggedShard((0,), units)])]
        before = len(fallbacks)
        promoted = torch._foreach_add(ints, 0.5)
        assert len(fallbacks) == before + 1 and promoted[0].dtype == torch.float32
        torch.testing.assert_close(promoted[0].full_tensor(), torch.arange(2 * rows) + 0.5)
    finally:
        _patches.dispatch_without_handler = dispatch


def _init_fills() -> list[Any]:
    """What nn.init and models' own init functions run, in place, on a parameter."""
    from torch import nn

    return [
        lambda t: nn.init.normal_(t, 0.0, 0.02),
        lambda t: nn.init.uniform_(t, -0.5, 0.5),
        lambda t: nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04),
        lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
        lambda t: nn.init.xavier_normal_(t),
        lambda t: t.bernoulli_(0.3),
    ]


def check_random_fills(placements_kind: str, units: tuple[int, ...]) -> None:
    """A random fill of a RaggedShard DTensor equals the same fill of the full tensor in one
    process (same seed), so it does not depend on the world size or the layout."""
    if placements_kind == "tp":  # (fsdp, tp) mesh: RaggedShard beside Shard(1)
        mesh = init_device_mesh("cpu", (2, 2))
        placements: list[Any] = [RaggedShard((0,), units), Shard(1)]
        shape: tuple[int, ...] = (4 * sum(units), 6)
    else:
        mesh = make_mesh()
        placements = [RaggedShard((0,), units)]
        shape = (3 * sum(units), 5)
    for index, fill in enumerate(_init_fills()):
        for dtype in (torch.float32, torch.bfloat16):
            ref = torch.zeros(shape, dtype=dtype)
            dt = distribute_tensor(ref.clone(), mesh, placements, src_data_rank=None)
            torch.manual_seed(100 + index)
            fill(ref)
            torch.manual_seed(100 + index)
            fill(dt)
            assert torch.equal(dt.full_tensor(), ref), (index, dtype, units)
            assert dt.placements == tuple(placements)
    # `any` steers control flow (trunc_normal_'s rejection loop): the same answer on every
    # rank, also on a rank whose piece is empty or has no True.
    hits = torch.zeros(shape, dtype=torch.bool)
    hits[-1, -1] = True  # in the last rank's piece, or the last non-empty one
    for mask, expected in ((hits, True), (torch.zeros_like(hits), False)):
        got = distribute_tensor(mask, mesh, placements, src_data_rank=None).any()
        assert bool(got) is expected and got.placements == (Replicate(),) * mesh.ndim
    # A user's generator: the same state on every rank gives one process's values.
    ref = torch.zeros(shape)
    dt = distribute_tensor(ref.clone(), mesh, placements, src_data_rank=None)
    ref.normal_(generator=torch.Generator().manual_seed(3))
    dt.normal_(generator=torch.Generator().manual_seed(3))
    assert torch.equal(dt.full_tensor(), ref)
    # Random ops other than those fills would differ per rank: refused, naming the op.
    expect_error(NotImplementedError, lambda: dt.exponential_(), "exponential_")
    expect_error(NotImplementedError, lambda: torch.rand_like(dt), "in-place fills")
    # On the meta device (before to_empty) a fill is a no-op, not an error.
    meta = distribute_tensor(torch.empty(shape, device="meta"), mesh, placements)
    meta.uniform_()
    assert meta.is_meta
