"""fsdp_engine's torch internals, on the torch version under test."""

import os
import subprocess
import sys

import pytest
import torch

from fsdp_engine import _compat


def test_backward_callback_runs_once_after_the_backward_pass() -> None:
    events: list[str] = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        events.append("hook")
        _compat.queue_backward_callback(lambda: events.append("end"))
        return grad

    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    assert events == ["hook", "end"], events
    y2 = x * 3
    y2.sum().backward()
    assert events == ["hook", "end"], events  # queued for one backward pass only


def test_unsupported_version_is_refused_at_import() -> None:
    code = "import torch; torch.__version__ = '2.99.0'; import fsdp_engine"
    env = {k: v for k, v in os.environ.items() if k != "RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode != 0
    assert "supports torch 2.10 to 2.15; found torch 2.99.0" in result.stderr, result.stderr


def test_profiler_range_only_under_a_profiler() -> None:
    from torch.profiler import profile, record_function

    idle = _compat.profiler_range("FSDP::test")
    assert not isinstance(idle, record_function)  # no profiler: a no-op context, no range
    with idle:
        pass
    with profile() as prof, _compat.profiler_range("FSDP::test"):
        torch.ones(2).sum()
    assert any(e.name == "FSDP::test" for e in prof.events())


def test_map_tensors_keeps_every_container_class() -> None:
    import collections
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Pair:
        a: torch.Tensor
        b: object

    class Custom(dict):  # a dict subclass pytree does not know
        pass

    Point = collections.namedtuple("Point", ["x", "y"])
    one = torch.ones(2)
    tree = (
        [one, 3],
        {"p": Pair(one, "text"), "c": Custom(t=one)},
        collections.OrderedDict(n=Point(one, None)),
    )
    out = _compat.map_tensors(tree, lambda t: t * 2)
    assert type(out) is tuple and type(out[0]) is list and out[0][1] == 3
    assert type(out[1]["p"]) is Pair and out[1]["p"].b == "text"
    assert type(out[1]["c"]) is Custom and type(out[2]) is collections.OrderedDict
    assert type(out[2]["n"]) is Point and out[2]["n"].y is None
    for doubled in (out[0][0], out[1]["p"].a, out[1]["c"]["t"], out[2]["n"].x):
        assert torch.equal(doubled, one * 2)
    assert torch.equal(tree[1]["c"]["t"], one)  # the input is not modified


def test_parameter_slots_is_the_live_parameter_dict() -> None:
    linear = torch.nn.Linear(2, 3)
    slots = _compat.parameter_slots(linear)
    assert set(slots) == {"weight", "bias"} and slots["weight"] is linear.weight
    replacement = torch.nn.Parameter(torch.zeros(3, 2))
    slots["weight"] = replacement
    assert linear.weight is replacement and dict(linear.named_parameters())["weight"] is replacement
    del slots["bias"]
    assert [name for name, _ in linear.named_parameters()] == ["weight"]


def test_in_backward_only_while_autograd_runs_a_backward() -> None:
    seen: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(_compat.in_backward()))
    assert not _compat.in_backward()
    y.sum().backward()
    assert seen == [True] and not _compat.in_backward()


def test_apply_override_sees_every_conversion() -> None:
    calls: list[str] = []

    class Converting(_compat.ApplyOverride, torch.nn.Linear):
        def _fsdp_convert(self, fn: object, apply: object) -> object:
            calls.append("convert")
            return apply()  # type: ignore[operator]

    layer = Converting(2, 3)
    assert layer.double() is layer and layer.weight.dtype == torch.float64
    layer.to(torch.float16)
    layer.to_empty(device="cpu")
    assert calls == ["convert"] * 3 and layer.weight.dtype == torch.float16
    plain = type("Plain", (_compat.ApplyOverride, torch.nn.Linear), {})(2, 3)
    assert plain.double().weight.dtype == torch.float64  # the default just applies


def test_ours_is_torchs_fsdp_module_and_overrides_every_method() -> None:
    # On every supported torch our FSDPModule is a subclass of torch's, and each method torch's
    # class defines (public or private) is defined by ours: working, or raising
    # NotImplementedError with the reason. None falls through to torch's FSDP2 code.
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    import fsdp_engine

    assert issubclass(fsdp_engine.FSDPModule, TorchFSDPModule)
    names = _compat.torch_fsdp_methods()
    assert len(names) >= 20 and {"unshard", "__new__", "_apply"} <= set(names), names
    ours = {name for cls in (fsdp_engine.FSDPModule, _compat.ApplyOverride) for name in vars(cls)}
    assert not [n for n in names if n not in ours], sorted(set(names) - ours)
    for name in names:
        assert getattr(fsdp_engine.FSDPModule, name) is not getattr(TorchFSDPModule, name), name
    public = [name for name in names if not name.startswith("_")]
    assert len(public) >= 18  # 18 on torch 2.10, 26 on 2.15


def test_fully_shard_state_reaches_ours_where_pipelining_reads_it(monkeypatch) -> None:
    # torch's pipeline stages call `fully_shard.state(stage)` and run what it holds; they bind
    # `fully_shard` at import, so it must work through torch's function and through ours
    # (a user who rebinds `torch.distributed.fsdp.fully_shard` before importing pipelining).
    import torch.distributed.fsdp
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp_engine

    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", fsdp_engine.fully_shard)
    calls: list[str] = []
    module = torch.nn.Linear(2, 2)
    _compat.set_fully_shard_state(
        module, lambda: [lambda: calls.append("post"), None], lambda: calls.append("final")
    )
    for lookup in (torch_fully_shard, fsdp_engine.fully_shard):
        calls.clear()
        view = lookup.state(module)  # type: ignore[attr-defined]
        for state in view._state_ctx.all_states:  # what torch 2.11-2.15's stage does
            for group in state._fsdp_param_groups:
                group.post_backward()
        groups = [s._fsdp_param_group is not None for s in view._state_ctx.all_states]
        assert groups == [True, False]
        view._root_post_backward_final_callback()
        assert calls == ["post", "final"], calls
    assert fsdp_engine.fully_shard.state(torch.nn.Linear(2, 2)) is None  # type: ignore[attr-defined]


def test_a_method_a_later_torch_adds_raises_naming_itself(monkeypatch) -> None:
    # What a torch release after 2.15 adds to FSDPModule must not run FSDP2's code on ours.
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fsdp_engine import _module

    def set_something_new(self: object, value: bool) -> None:
        raise AssertionError("torch's implementation ran")

    monkeypatch.setattr(TorchFSDPModule, "set_something_new", set_something_new, raising=False)
    _module._refuse_unknown_methods()
    try:
        method = _module.FSDPModule.set_something_new  # type: ignore[attr-defined]
        with pytest.raises(NotImplementedError, match=r"FSDPModule\.set_something_new"):
            method(object(), True)
    finally:
        if "set_something_new" in vars(_module.FSDPModule):
            delattr(_module.FSDPModule, "set_something_new")


@pytest.fixture
def fake_mesh_2d():
    """A (2, 2) mesh on torch's fake process group (this process plays rank 0 of 4)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2))
    finally:
        dist.destroy_process_group()


def test_norm_keys_group_by_mesh_and_sharded_axes(fake_mesh_2d) -> None:
    """Equal (mesh, placement kinds) give one key object, remembered per spec; devices by value."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fsdp_engine._norm_keys import norm_keys
    from ragged_placement import RaggedShard

    mesh = fake_mesh_2d
    local = torch.zeros(2, 3)

    def dtensor(*placements, piece=local):
        return DTensor.from_local(piece, mesh, placements, shape=(4, 6), stride=(6, 1))

    a, b = dtensor(Shard(0), Replicate()), dtensor(Shard(1), Replicate())
    c = dtensor(Replicate(), RaggedShard((0,), (2, 2)), piece=torch.zeros(12))
    d = dtensor(Replicate(), Replicate())
    keys = norm_keys([a, b, c, d])
    assert keys[0] is keys[1] and keys[0] == (mesh, (0,))  # Shard(0) and Shard(1): kinds
    assert keys[2] == (mesh, (1,)) and keys[3] == (mesh, ())
    assert norm_keys([d, a])[1] is keys[0]  # remembered by spec: the same objects
    e = dtensor(Shard(0), Replicate())  # a new spec, the same kinds: the same key
    assert norm_keys([e])[0] is keys[0]
    plain = norm_keys([torch.zeros(1), torch.zeros(2), a])
    assert plain[0] is plain[1] and plain[0] == (torch.device("cpu"), ())
    assert plain[2] is keys[0]
