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


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 0.0])
@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_equals_torch_on_plain_tensors(norm_type, max_norm) -> None:
    ours, theirs = _params(0), _params(0)
    for params in (ours, theirs):  # torch's 0-norm counts the tensors with a non-zero
        params[1].grad.zero_()
    got = clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    torch.testing.assert_close(got, expected)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_edge_cases_and_bad_input() -> None:
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0)) == 0.0
    one = _params(1)[0]
    assert float(clip_grad_norm_(one, 1e9)) == float(one.grad.norm())  # a single tensor
    for bad in (-1.0, True, "1", float("nan")):
        with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
            clip_grad_norm_(_params(2), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_type must be a number or inf, got nan"):
        clip_grad_norm_(_params(2), 1.0, norm_type=float("nan"))
    for bad in ("pp", 2):
        with pytest.raises(ValueError, match="pp_mesh must be a 1-D DeviceMesh or None"):
            clip_grad_norm_(_params(2), 1.0, pp_mesh=bad)  # type: ignore[arg-type]
    params = _params(3)
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


@pytest.fixture
def fake_mesh():
    """A 1-D mesh of 4 on torch's fake process group (this process plays rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def test_a_partial_gradient_is_refused_by_name(fake_mesh) -> None:
    from torch.distributed.tensor import DTensor, Partial, Shard

    params, _ = _sharded_params(fake_mesh, 2)
    params[1].grad = DTensor.from_local(torch.ones(8, 3), fake_mesh, [Partial()])
    with pytest.raises(ValueError, match=r"gradient 1 is a DTensor with placements \(Partial"):
        clip_grad_norm_(params, 1.0)
    assert isinstance(params[0].grad.placements[0], Shard)


def _sharded_params(mesh, num_params: int) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    """Shard(0) parameters whose gradients view one storage back to back (as a DBuffer's)."""
    from torch.distributed.tensor import DTensor, Shard

    grads = torch.randn(num_params * 6, generator=torch.Generator().manual_seed(num_params))
    params = []
    for i in range(num_params):
        param = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], shape=(8, 3), stride=(3, 1))
        param = torch.nn.Parameter(param)
        param.grad = DTensor.from_local(
            grads[i * 6 : (i + 1) * 6].view(2, 3), mesh, [Shard(0)], shape=(8, 3), stride=(3, 1)
        )
        params.append(param)
    return params, grads


def test_python_calls_do_not_grow_with_parameters(fake_mesh) -> None:
    """One norm and one scale per run of adjacent gradients: the same calls at 16 and 64."""
    import cProfile
    import pstats

    calls = []
    for num_params in (16, 64):
        params, grads = _sharded_params(fake_mesh, num_params)
        expected = torch.linalg.vector_norm(grads)  # the fake group reduces nothing
        before = grads.clone()
        clip_grad_norm_(params, 1e9)  # warm: each spec's norm key is remembered
        profiler = cProfile.Profile()
        profiler.enable()
        total = clip_grad_norm_(params, 0.5)
        profiler.disable()
        calls.append(pstats.Stats(profiler).total_calls)  # type: ignore[attr-defined]
        torch.testing.assert_close(total, expected)
        torch.testing.assert_close(grads, before * (0.5 / (float(expected) + 1e-6)))
    assert calls[0] == calls[1], calls
