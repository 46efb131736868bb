"""The torch hooks: version guard, installation and redirection, on the torch version under test."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.tensor as dtensor_pkg
import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute

import ragged_placement
from ragged_placement import _compat


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        # The override comes only from `env`: a caller's own setting would mask the refusal.
        env={**{k: v for k, v in os.environ.items() if k != _compat.ALLOW_UNTESTED_TORCH}, **env},
    )


def test_running_torch_is_supported_and_exported() -> None:
    assert _compat.torch_version() in ragged_placement.SUPPORTED_TORCH, torch.__version__
    ragged_placement.check_torch_version("anything")  # returns quietly
    with pytest.raises(TypeError, match="takes the package name"):
        ragged_placement.check_torch_version(3)  # type: ignore[arg-type]


def test_every_binding_of_a_redirected_function_reaches_the_wrapper() -> None:
    # torch's own modules bind redistribute_local_tensor by name; all see the same function,
    # which now forwards to the wrapper, and the wrapper's original is the untouched code.
    redistribute = dtensor_redistribute.redistribute_local_tensor
    assert dtensor_dispatch.redistribute_local_tensor is redistribute
    assert dtensor_api.redistribute_local_tensor is redistribute
    assert dtensor_pkg.distribute_tensor is dtensor_api.distribute_tensor
    import torch.distributed._state_dict_utils as state_dict_utils

    for fn in (
        redistribute,
        dtensor_api.distribute_tensor,
        dtensor_pkg.DTensor.from_local,
        state_dict_utils._distribute_tensors,  # cuts full state dicts when loading
    ):
        assert fn.__code__.co_filename.startswith("<ragged_placement forwarding"), fn
        assert fn.__wrapped__.__code__.co_filename.endswith(".py"), fn  # torch's own source


def test_redirect_keeps_signature_defaults_and_identity() -> None:
    namespace: dict[str, object] = {}
    exec(
        "def f(a, /, b, c=3, *args, d, e=5, **kw):\n    return (a, b, c, args, d, e, kw)\n",
        namespace,
    )
    f = namespace["f"]
    before = f
    _compat.redirect(f, lambda original: lambda *a, **k: ("wrapped", original(*a, **k)))
    assert namespace["f"] is before
    assert f(1, 2, d=4) == ("wrapped", (1, 2, 3, (), 4, 5, {}))
    assert f(1, 2, 9, 8, d=4, e=6, z=7) == ("wrapped", (1, 2, 9, (8,), 4, 6, {"z": 7}))
    with pytest.raises(TypeError):
        f(a=1, b=2, d=4)  # a stays positional-only


def test_redirect_refuses_a_closure() -> None:
    def outer() -> object:
        x = 1
        return lambda: x

    with pytest.raises(ImportError, match=r"on torch .*no longer a plain function"):
        _compat.redirect(outer(), lambda original: original)  # type: ignore[arg-type]


def test_unsupported_version_is_refused_at_import_unless_allowed() -> None:
    code = """
        import torch
        torch.__version__ = "2.99.0"
        import ragged_placement
        print("imported")
    """
    refused = _python(code)
    assert refused.returncode != 0
    assert (
        "ImportError: ragged_placement supports torch 2.10 to 2.15; found torch 2.99.0; "
        "set RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH=1 to try it anyway" in refused.stderr
    ), refused.stderr
    allowed = _python(code, RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH="1")
    assert allowed.returncode == 0 and "imported" in allowed.stdout, allowed.stderr
    assert "allowed by RAGGED_PLACEMENT_ALLOW_UNTESTED_TORCH=1" in allowed.stderr


def test_a_missing_torch_internal_fails_at_import_naming_the_version() -> None:
    result = _python(
        """
        import torch.distributed.tensor._sharding_prop as sp
        del sp.ShardingPropagator.propagate
        import ragged_placement
        """
    )
    assert result.returncode != 0
    assert "ImportError: ragged_placement cannot install its DTensor hooks on torch" in (
        result.stderr
    ), result.stderr
    assert "propagate" in result.stderr, result.stderr


def test_install_is_idempotent() -> None:
    before = dtensor_redistribute.redistribute_local_tensor.__wrapped__
    _compat.install(object())  # type: ignore[arg-type]  (already installed: returns at once)
    assert dtensor_redistribute.redistribute_local_tensor.__wrapped__ is before


def test_names_bound_before_the_import_work_with_ragged_shard(tmp_path) -> None:
    # A user's module that binds torch's entry points before ragged_placement is imported.
    result = _python(
        f"""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
        from torch.distributed.tensor._redistribute import redistribute_local_tensor
        from_local = DTensor.from_local

        import ragged_placement
        from ragged_placement import RaggedShard

        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(4, 3)
        placement = RaggedShard((0,), (1,))
        dt = distribute_tensor(full, mesh, [placement])
        assert dt.placements == (placement,), dt.placements
        local = dt.to_local().clone().requires_grad_()
        again = from_local(local, mesh, [placement], shape=full.shape)
        assert torch.equal(again.redistribute(mesh, [Replicate()]).to_local(), full)
        again.sum().full_tensor().backward()
        assert torch.equal(local.grad, torch.ones_like(local))
        from torch.distributed.tensor import _dispatch
        assert redistribute_local_tensor is _dispatch.redistribute_local_tensor
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_exit_waits_for_gloo_worker_threads(tmp_path) -> None:
    # A gloo worker thread that frees a Python-made tensor after shutdown began aborts the
    # process; the exit handler sleeps (releasing the GIL) while such threads exist.
    result = _python(
        f"""
        import time
        import torch.distributed as dist
        from ragged_placement._compat import _gloo_exit
        # (torch 2.10 leaves gloo's threads unnamed: there the handler always waits.)
        assert _gloo_exit.gloo_threads_alive() != _gloo_exit.GLOO_NAMES_ITS_THREADS
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        # The worker threads name themselves some time after they start: wait for it.
        deadline = time.monotonic() + 30
        while not _gloo_exit.gloo_threads_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _gloo_exit.gloo_threads_alive()
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_ragged_sharding_decisions_are_cached_per_schema(tmp_path) -> None:
    # Every path into the Python propagator (torch's own `propagate`, the dispatcher's slow
    # path) reuses a decision: fake-tensor propagation runs once per distinct schema, not per
    # call. Values that are not part of the schema (an alpha) do not change the decision;
    # another shape does.
    result = _python(
        f"""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        import ragged_placement
        from ragged_placement import RaggedShard

        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        metas = []
        original = ShardingPropagator._propagate_tensor_meta_non_cached
        def counted(self, schema):
            metas.append(schema.op)
            return original(self, schema)
        ShardingPropagator._propagate_tensor_meta_non_cached = counted

        def ragged(*shape):
            return distribute_tensor(torch.ones(shape), mesh, [RaggedShard((0,), (1,))])

        dispatcher = DTensor._op_dispatcher
        params, grads = [ragged(4, 3), ragged(5)], [ragged(4, 3), ragged(5)]
        op = torch.ops.aten._foreach_add_.List
        for alpha in (1.0, 2.0, 3.0):
            info = dispatcher.unwrap_to_op_info(op, (params, grads), {{"alpha": alpha}})
            dispatcher.sharding_propagator.propagate(info)
            assert info.output_sharding is not None
            sharding = dispatcher._propagate_op_sharding_dispatch_slow_path(
                op, (params, grads), {{"alpha": alpha}}, info, True
            )
            assert sharding.output_spec == info.output_sharding.output_spec
        # A foreach op is decided entry by entry ("columns"): one propagation per distinct
        # entry, whatever lists they come in (an optimizer whose parameters with a gradient
        # change from step to step).
        assert metas == [op, op], metas
        for lists in ((params[::-1], grads[::-1]), ([params[1]], [grads[1]])):
            info = dispatcher.unwrap_to_op_info(op, lists, {{"alpha": 4.0}})
            dispatcher.sharding_propagator.propagate(info)
        assert metas == [op, op], metas
        other = dispatcher.unwrap_to_op_info(op, ([ragged(2, 3)], [ragged(2, 3)]), {{}})
        dispatcher.sharding_propagator.propagate(other)
        assert metas == [op, op, op], metas
        torch._foreach_add_(params, grads, alpha=2.0)  # the cached decision computes right
        assert torch.equal(params[0].full_tensor(), torch.full((4, 3), 3.0))
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_random_ops_torch_routes_through_python_include_the_fills() -> None:
    # RaggedShard random fills hook the Python local-results path, which torch takes for the
    # ops it lists as random; nn.init needs normal_ and uniform_ among them.
    from ragged_placement._ops import RANDOM_FILLS

    ops = torch.ops.aten
    assert {ops.normal_.default, ops.uniform_.default} <= RANDOM_FILLS
    assert _compat.dtensor_random_ops() >= RANDOM_FILLS
    patched = dtensor_dispatch.OpDispatcher._dispatch_get_local_results_slow_path
    assert patched.__code__.co_name == "local_results" and patched.__wrapped__, patched


def test_foreach_handlers_are_installed_and_lifted_for_one_call(tmp_path) -> None:
    result = _python(
        f"""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
        from ragged_placement import _compat

        handlers = DTensor._op_dispatcher._custom_op_handlers
        ops = torch.ops.aten
        for op in (ops._foreach_add_.List, ops._foreach_lerp_.Scalar, ops._foreach_norm.Scalar):
            assert op in handlers, op
        assert ops._foreach_max.default not in handlers  # a reduction, not elementwise
        assert ops._fused_adamw_.default in handlers  # torch's fused optimizer kernels
        for op in (ops.view.default, ops.sum.dim_IntList, ops.linalg_vector_norm.default):
            assert op not in handlers, op  # rules: a handler would cost every DTensor call
        calls = []
        handlers[ops._foreach_add_.List] = lambda *a: calls.append(a)
        mesh = init_device_mesh("cpu", (1,))
        x = [distribute_tensor(torch.ones(3), mesh, [Replicate()])]
        torch._foreach_add_(x, x)  # through the (probing) handler
        assert len(calls) == 1 and torch.equal(x[0].to_local(), torch.ones(3))
        _compat.dispatch_without_handler(ops._foreach_add_.List, (x, x), {{}})
        assert len(calls) == 1, calls  # lifted for that call: DTensor's own dispatch ran
        assert torch.equal(x[0].to_local(), torch.full((3,), 2.0))
        assert handlers[ops._foreach_add_.List] is not None  # and put back
        torch._foreach_add_(x, x)
        assert len(calls) == 2
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_compile_cache_key_of_a_ragged_dtensor_is_its_rank_s_piece() -> None:
    # torch.compile's on-disk cache keys a DTensor by spec and device: every rank of a CPU
    # mesh would get one key for pieces of three shapes. A RaggedShard's key names the piece
    # (equal pieces share one); other placements keep torch's key.
    if not hasattr(dtensor_pkg.DTensor, "_stable_hash_for_caching"):
        pytest.skip(
            f"torch {torch.__version__} has no DTensor._stable_hash_for_caching to extend "
            "(tests/test_compile_cache.py checks a shared cache on every torch)"
        )
    result = _python(
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from ragged_placement import RaggedShard

        keys = {"ragged": [], "equal": [], "shard": [], "shard_torch": []}
        for rank in range(3):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=3)
            mesh = DeviceMesh("cpu", [0, 1, 2])
            for name, rows in (("ragged", (4, 0, 2)), ("equal", (2, 2, 2))):
                piece = torch.zeros(rows[rank] * 5)
                dt = DTensor.from_local(
                    piece, mesh, [RaggedShard((0,), rows)], shape=(6, 5), stride=(5, 1)
                )
                keys[name].append(dt._stable_hash_for_caching())
            dt = DTensor.from_local(torch.zeros(2, 5), mesh, [Shard(0)])
            keys["shard"].append(dt._stable_hash_for_caching())
            ours = DTensor._stable_hash_for_caching
            keys["shard_torch"].append(getattr(ours, "__wrapped__", ours)(dt))
            dist.destroy_process_group()
        assert len(set(keys["ragged"])) == 3, keys["ragged"]
        assert len(set(keys["equal"])) == 1, keys["equal"]
        assert keys["shard"] == keys["shard_torch"], keys
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
