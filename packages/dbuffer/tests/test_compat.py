"""dbuffer's torch internals, on the torch version under test."""

import os
import subprocess
import sys

import torch

from dbuffer import _compat
from ragged_placement import SUPPORTED_TORCH


def test_running_torch_is_supported() -> None:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert (major, minor) in SUPPORTED_TORCH, torch.__version__


def test_unsupported_version_is_refused_at_import() -> None:
    # ragged_placement's guard (imported first by dbuffer) refuses, naming the versions.
    result = subprocess.run(
        [sys.executable, "-c", "import torch; torch.__version__ = '2.99.0'; import dbuffer"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH"},
    )
    assert result.returncode != 0
    assert "supports torch 2.10 to 2.15; found torch 2.99.0" in result.stderr, result.stderr


def test_plain_tensor_ops_skips_subclass_overrides() -> None:
    calls = []

    class Recorded(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func)
            with _compat.plain_tensor_ops():
                return func(*args, **(kwargs or {}))

    x = torch.ones(3).as_subclass(Recorded)
    out = x + 1
    assert len(calls) == 1 and type(out) is torch.Tensor  # outputs stay plain
    with _compat.plain_tensor_ops():
        x.sum()
    assert len(calls) == 1  # the override is skipped inside the context


def test_set_version_moves_the_counter_views_share() -> None:
    base = torch.zeros(8)
    view = torch.nn.Parameter(base[2:6])
    x = torch.ones(4, requires_grad=True)
    saved = (x * view).sum()  # autograd saved the view at version 0
    _compat.set_version(base, 1)
    assert (base._version, view._version) == (1, 1)
    try:
        saved.backward(retain_graph=True)
    except RuntimeError as exc:
        assert "modified by an inplace operation" in str(exc), exc
    else:
        raise AssertionError("autograd must refuse a saved view at another version")
    _compat.set_version(base, 0)
    saved.backward()
    assert torch.equal(x.grad, torch.zeros(4))


def test_profiler_range_only_under_a_profiler() -> None:
    from torch.profiler import profile, record_function

    idle = _compat.profiler_range("DBuffer::test")
    assert not isinstance(idle, record_function)  # no profiler: a no-op context, no range
    with idle:
        pass
    with profile() as prof, _compat.profiler_range("DBuffer::test"):
        torch.ones(2).sum()
    assert any(e.name == "DBuffer::test" for e in prof.events())


def test_collective_names_and_foreach_ops() -> None:
    import torch.distributed as dist

    expected = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert _compat.all_gather_single is expected
    expected = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    assert _compat.reduce_scatter_single is expected
    dst = [torch.zeros(2), torch.zeros(3)]
    _compat.foreach_copy_(dst, [torch.ones(2, dtype=torch.bfloat16), torch.full((3,), 2.0)])
    _compat.foreach_add_(dst, [torch.ones(2), torch.ones(3)])
    assert torch.equal(dst[0], torch.full((2,), 2.0)) and torch.equal(dst[1], torch.full((3,), 3.0))


def test_view_storage_and_version_helpers() -> None:
    base = torch.zeros(6)
    view = base[2:5]
    assert _compat.is_view(view) and not _compat.is_view(base)
    assert _compat.base_of(view) is base and _compat.base_of(base) is None
    assert _compat.storage_key(view) == _compat.storage_key(base)
    assert _compat.storage_key(torch.zeros(6)) != _compat.storage_key(base)
    before = _compat.version_of(base)
    view.add_(1)
    assert _compat.version_of(base) == _compat.version_of(view) == before + 1
    assert _compat.TENSOR_DATA_GET(view).data_ptr() == view.data_ptr()
    assert _compat.TENSOR_IS_VIEW(view)


_CONCATENATE = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from dbuffer import _compat

dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
both = _compat.concatenate_meshes([mesh["dp"], mesh["tp"]])
assert both.mesh_dim_names == ("dp", "tp") and tuple(both.shape) == (2, 2), both
assert both.mesh.tolist() == [[0, 1], [2, 3]], both.mesh
assert both.get_group(1) is mesh["tp"].get_group(), "the axes' process groups are reused"
other = init_device_mesh("cpu", (4,), mesh_dim_names=("other",))
try:
    _compat.concatenate_meshes([other, mesh["tp"]])
except RuntimeError:
    pass
else:
    raise AssertionError("meshes of two roots must not concatenate")
print("ok")
"""


def test_concatenate_meshes_reuses_the_axes_groups() -> None:
    # In a child process: it initializes a (fake) default process group.
    result = subprocess.run(
        [sys.executable, "-c", _CONCATENATE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
