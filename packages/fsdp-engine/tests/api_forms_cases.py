"""FSDP2's argument forms beyond the defaults, run on every rank of a RankPool.

`shard_placement_fn` returning Shard(d) for d > 0 (torchtitan's experts when the FSDP degree
exceeds their number) or a `ShardPlacementResult` with the parameter's own mesh (experts beside
expert parallelism); `dp_mesh_dims` (the full SPMD mesh and the names of its data axes); and an
int `reshard_after_forward` (backward gathers over fewer ranks). Each trains equal to one
process on the whole batch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from engine_support import full_params
from model import Config, Decoder, loss_fn
from rank_pool import expect_error
from side_by_side import steps_side_by_side
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_engine import fully_shard
from ragged_placement import RaggedShard

ROWS = 2  # rows of the batch per data-parallel rank


class Experts(nn.Module):
    """A fused expert weight (E, H, F), each row of x through every expert, plus a bias."""

    def __init__(self, num_experts: int = 2, hidden: int = 12, ffn: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(num_experts, hidden, ffn) / hidden**0.5)
        self.bias = nn.Parameter(torch.randn(ffn) * 0.1)
        self.proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bh,ehf->bf", x, self.w) + self.bias
        return self.proj(torch.tanh(h))


def _batch(step: int, num_replicas: int, dim: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(num_replicas * ROWS, dim, generator=gen)


def _sgd_steps(model: nn.Module, replica: int | None, num_replicas: int, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(steps):
        x = _batch(step, num_replicas)
        if replica is not None:
            x = x[replica * ROWS : (replica + 1) * ROWS]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_equal_to(reference: nn.Module, model: nn.Module) -> None:
    expected, got = full_params(reference), full_params(model)
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def check_shard_dim_cuts_inside_experts() -> None:
    """Shard(1) on (E, H, F) with E=2: cuts inside experts, trains equal to one process."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = Experts()
    model = copy.deepcopy(reference)
    dims = {"w": Shard(1), "bias": Shard(-1), "proj.weight": None, "proj.bias": Shard(0)}
    by_param = {p: dims[n] for n, p in model.named_parameters()}
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: by_param[p])
    placement = model.w.placements[0]
    assert isinstance(placement, RaggedShard) and placement.dims == (0, 1), placement
    assert model.bias.placements[0].dims == (0,)
    # Whole experts would give every rank a multiple of H * F elements of w; here some rank
    # holds part of an expert (the planner balances rows of F elements).
    cut_inside = torch.tensor([int(model.w.to_local().numel() % (12 * 8) != 0)])
    dist.all_reduce(cut_inside, op=dist.ReduceOp.MAX)
    assert cut_inside.item() == int(world > 1)
    _sgd_steps(model, rank, world)
    _sgd_steps(reference, None, world)
    _assert_equal_to(reference, model)
    expect_error(
        ValueError,
        lambda: fully_shard(Experts(), mesh=mesh, shard_placement_fn=lambda p: Shard(3)),
        "valid: None, Shard(d) with -3 <= d < 3",
    )
    expect_error(
        ValueError,
        lambda: fully_shard(Experts(), mesh=mesh, shard_placement_fn=lambda p: Replicate()),
        "shard_placement_fn returned Replicate()",
    )


def check_placement_result_puts_experts_on_their_own_mesh() -> None:
    """ShardPlacementResult: experts HSDP over a (2, 2) mesh, the rest over all 4 ranks."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    torch.manual_seed(0)
    reference = Experts()
    model = copy.deepcopy(reference)

    def placement(param: nn.Parameter) -> Any:
        return ShardPlacementResult(Shard(1), info) if param is model.w else None

    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    assert model.w.device_mesh.shape == (2, 2)
    assert model.w.placements[0] == Replicate() and model.w.placements[1].dims == (0, 1)
    assert model.proj.weight.device_mesh.shape == (4,)
    _sgd_steps(model, rank, 4)
    _sgd_steps(reference, None, 4)
    _assert_equal_to(reference, model)


class SpmdMLP(nn.Module):
    """Two linears as DTensors on a mesh whose first axes are data axes.

    With a last axis "tp": column-, then row-parallel over it. Inputs are Shard(0) on the
    data axes (each rank its rows); weights Replicate there.
    """

    def __init__(self, mesh: Any, dim: int = 12, hidden: int = 6) -> None:
        super().__init__()
        self.mesh = mesh
        self.tp = mesh.mesh_dim_names[-1] == "tp"
        torch.manual_seed(0)
        w1, w2 = torch.randn(hidden, dim) / dim**0.5, torch.randn(dim, hidden) / hidden**0.5
        data = [Replicate()] * (mesh.ndim - 1 if self.tp else mesh.ndim)
        tp1, tp2 = ([Shard(0)], [Shard(1)]) if self.tp else ([], [])
        self.w1 = nn.Parameter(distribute_tensor(w1, mesh, data + tp1))
        self.w2 = nn.Parameter(distribute_tensor(w2, mesh, data + tp2))
        self.rows = [Shard(0)] * len(data) + ([Replicate()] if self.tp else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(x, self.mesh, self.rows)
        h = torch.tanh(x @ self.w1.t())
        return (h @ self.w2.t()).redistribute(self.mesh, self.rows).to_local()


def _one_process_mlp(model: SpmdMLP) -> nn.Module:
    plain = nn.Module()
    plain.w1, plain.w2 = (
        nn.Parameter(getattr(model, n).full_tensor().clone()) for n in ("w1", "w2")
    )
    plain.forward = lambda x: torch.tanh(x @ plain.w1.t()) @ plain.w2.t()  # type: ignore[method-assign]
    return plain


def _train_against_one_process(model: SpmdMLP, plain: nn.Module, replica: int, num: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.3)
    for step in range(2):
        x = _batch(step, num)
        model(x[replica * ROWS : (replica + 1) * ROWS]).pow(2).mean().backward()
        plain(x).pow(2).mean().backward()
        for opt_ in (opt, ref_opt):
            opt_.step()
            opt_.zero_grad()
    for name in ("w1", "w2"):
        got = getattr(model, name).full_tensor()
        torch.testing.assert_close(got, getattr(plain, name).detach(), msg=name)


def check_dp_mesh_dims() -> None:
    """dp_mesh_dims on a (dp 2, tp 2) mesh and on an all-data (2, 2) mesh: as one process."""
    from torch.distributed.fsdp import DataParallelMeshDims

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = SpmdMLP(mesh)
    plain = _one_process_mlp(model)
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert model.w1.placements[1] == Shard(0) and isinstance(model.w1.placements[0], RaggedShard)
    _train_against_one_process(model, plain, mesh.get_local_rank("dp"), 2)
    # All-data meshes: HSDP by names, and two axes flattened into one shard axis.
    data = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    for dims, shape in [
        (DataParallelMeshDims(shard="shard", replicate="rep"), (2, 2)),
        (DataParallelMeshDims(shard=("rep", "shard")), (4,)),
    ]:
        model = SpmdMLP(data)
        plain = _one_process_mlp(model)
        fully_shard(model, mesh=data, dp_mesh_dims=dims)
        assert model.w1.device_mesh.shape == shape, (dims, model.w1.device_mesh)
        _train_against_one_process(model, plain, rank, 4)
    # What FSDP2 refuses too: a plain parameter, a data axis that is not Replicate.
    expect_error(
        ValueError,
        lambda: fully_shard(Experts(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
        "is a plain tensor",
    )
    sharded_on_dp = SpmdMLP(mesh)
    w1 = sharded_on_dp.w1.full_tensor().detach()
    sharded_on_dp.w1 = nn.Parameter(distribute_tensor(w1, mesh, [Shard(0), Shard(0)]))
    expect_error(
        ValueError,
        lambda: fully_shard(
            sharded_on_dp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")
        ),
        "on data axis 'dp'",
    )
    expect_error(
        ValueError,
        lambda: fully_shard(
            SpmdMLP(mesh), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="nope")
        ),
        "not axes of the mesh ('dp', 'tp')",
    )
    expect_error(
        ValueError,
        lambda: fully_shard(
            SpmdMLP(mesh), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp")
        ),
        "names no shard axis",
    )
    expect_error(
        TypeError,
        lambda: fully_shard(SpmdMLP(mesh), mesh=mesh, dp_mesh_dims="dp"),
        "must be a torch.distributed.fsdp.DataParallelMeshDims",
    )
    expect_error(
        ValueError,
        lambda: fully_shard(SpmdMLP(mesh), mesh=None, dp_mesh_dims=DataParallelMeshDims("dp")),
        "needs mesh: the full DeviceMesh with named axes",
    )


def _count_kept_gathers(model: nn.Module, tokens: torch.Tensor) -> int:
    with torch.profiler.profile() as prof:
        loss_fn(model(tokens), tokens).backward()
    return sum(1 for e in prof.events() if e.name == "DBuffer::all_gather_kept")


def check_reshard_after_forward_int(parts: int) -> None:
    """reshard_after_forward=k: backward gathers over k ranks, results as with True."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = Decoder(Config())
    models = {"int": copy.deepcopy(reference), "bool": copy.deepcopy(reference)}
    for key, model in models.items():
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=parts if key == "int" else True)
        fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, Config().vocab, (world, 9), generator=gen) for _ in range(2)]
    kept = _count_kept_gathers(models["int"], batches[0][rank : rank + 1])
    # One per layer group when 1 < k < world; none when k == world (True) or 1 (False).
    assert kept == (len(reference.layers) if 1 < parts < world else 0), kept
    # The bool setter replaces the int (its one home is the group's config).
    models["int"].layers[0].set_reshard_after_forward(True, recurse=False)
    kept = _count_kept_gathers(models["int"], batches[0][rank : rank + 1])
    assert kept == (len(reference.layers) - 1 if 1 < parts < world else 0), kept
    models["int"].layers[0].set_reshard_after_forward(False, recurse=False)
    for model in models.values():
        model.zero_grad()
    sharded = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in models.values()]
    one = (reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    steps_side_by_side(sharded, one, batches, rank, loss_fn)
    for name, value in full_params(models["bool"]).items():
        assert torch.equal(full_params(models["int"])[name], value), name
    _assert_equal_to(reference, models["int"])
    if world == 4:
        expect_error(
            ValueError,
            lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, reshard_after_forward=3),
            "valid: True, False, None or one of [1, 2, 4]",
        )


class PlainMLP(nn.Module):
    """SpmdMLP's maths on plain parameters (what torchtitan's spmd_types backend builds)."""

    def __init__(self, dim: int = 12, hidden: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1.t()) @ self.w2.t()


def check_spmd_types_parameters() -> None:
    """Plain parameters annotated Replicate on a data-only mesh (torch 2.15's FSDP2 takes
    them, torchtitan's default backend makes them): sharded over the data axes, computed as
    plain tensors, equal to one process; on a mesh with an expert-parallel axis, and under
    spmd_types type checking, refused by name."""
    import spmd_types as spmd
    from spmd_types.checker import typecheck
    from torch.distributed.fsdp import DataParallelMeshDims

    rank, world = dist.get_rank(), dist.get_world_size()

    def annotated(mesh: Any, types: dict[str, Any]) -> PlainMLP:
        model = PlainMLP()
        for param in model.parameters():
            spmd.assert_type(
                param, {spmd.MeshAxis.of(mesh.get_group(n)): t for n, t in types.items()}
            )
        return model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = annotated(mesh, {"dp_shard": spmd.R})
    plain = PlainMLP()
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    assert isinstance(model.w1.placements[0], RaggedShard), model.w1.placements
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.3)
    for step in range(2):
        x = _batch(step, world)
        out = model(x[rank * ROWS : (rank + 1) * ROWS])
        assert not isinstance(out, DTensor)  # the gathered parameters are plain tensors
        out.pow(2).mean().backward()
        plain(x).pow(2).mean().backward()
        for opt_ in (opt, ref_opt):
            opt_.step()
            opt_.zero_grad()
    for name in ("w1", "w2"):
        torch.testing.assert_close(
            getattr(model, name).full_tensor(), getattr(plain, name).detach(), msg=name
        )
    with typecheck(local=False):
        expect_error(NotImplementedError, lambda: model(_batch(0, 1)), "type checking off")
    if world == 4:
        two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        expert = annotated(two, {"dp_shard": spmd.R, "ep": spmd.S(0)})
        expect_error(
            NotImplementedError,
            lambda: fully_shard(
                expert, mesh=two, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")
            ),
            "non-data axes ['ep']",
        )


class _Seen(nn.Module):
    """A linear layer that records the dtype its forward receives, then runs in its own."""

    def __init__(self, name: str, seen: list[tuple[str, torch.dtype]]) -> None:
        super().__init__()
        self.name, self.seen = name, seen
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.name, x.dtype))
        return self.lin(x.to(self.lin.weight.dtype))


def check_mixed_precision_casts() -> None:
    """`MixedPrecisionPolicy`'s `cast_forward_inputs` and `output_dtype`, as FSDP2 applies them.

    Root group in bf16 with float32 outputs; inside it a float32 group that does not cast its
    inputs, a float32 group that does, and a bf16 group. The dtype each module receives, the
    output dtypes and the gradients equal FSDP2's on the same model; the expected dtypes are
    spelled out too, so that both engines doing the same wrong thing fails.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    bf16, fp32 = torch.bfloat16, torch.float32
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policies = {
        "keep": MixedPrecisionPolicy(param_dtype=fp32, cast_forward_inputs=False),
        "cast": MixedPrecisionPolicy(param_dtype=fp32),
        "half": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
    }
    root_policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32)
    torch.manual_seed(0)
    runs = {}
    for engine, shard in (("ours", fully_shard), ("fsdp2", torch_fully_shard)):
        seen: list[tuple[str, torch.dtype]] = []
        torch.manual_seed(0)
        model = nn.Sequential(*(_Seen(name, seen) for name in ("root", "keep", "cast", "half")))
        for index, name in enumerate(policies, start=1):
            shard(model[index], mesh=mesh, mp_policy=policies[name])
        shard(model, mesh=mesh, mp_policy=root_policy)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
        out = model(x)
        out.square().sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        runs[engine] = (seen, out, grads)
    expected = [("root", bf16), ("keep", bf16), ("cast", fp32), ("half", bf16)]
    assert runs["ours"][0] == runs["fsdp2"][0] == expected, (runs["ours"][0], runs["fsdp2"][0])
    assert runs["ours"][1].dtype == runs["fsdp2"][1].dtype == fp32
    torch.testing.assert_close(runs["ours"][1], runs["fsdp2"][1])
    for name, grad in runs["ours"][2].items():
        assert grad.dtype == fp32, (name, grad.dtype)
        torch.testing.assert_close(grad, runs["fsdp2"][2][name], msg=name)


def _keep_norms(param: torch.Tensor) -> torch.dtype | None:
    """Norm weights (1-D) keep their own dtype; everything else takes param_dtype."""
    return param.dtype if param.dim() == 1 else None


class _Norm(nn.Module):
    """RMSNorm as Llama's: computed in fp32, returned in its input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (wide * self.weight).to(x.dtype)


class _NormBlock(nn.Module):
    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)  # 1-D parameters: the norms only
        self.norm = _Norm(2 * dim)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


def _train_norm_model(shard: Any, steps: int = 3) -> tuple[list[float], dict[str, torch.dtype]]:
    """Two blocks with norms, sharded by `shard(model)`, trained `steps` AdamW steps on this
    rank's rows; the losses and the dtype each parameter had in the first forward."""
    torch.manual_seed(0)
    model = nn.Sequential(_NormBlock(), _NormBlock())
    shard(model)
    seen: dict[str, torch.dtype] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, _args, prefix=prefix: seen.update(
                {f"{prefix}.{n}": p.dtype for n, p in mod.named_parameters(recurse=False)}
            )
        )
        for prefix, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(steps):
        x = _batch(step, world)[rank * ROWS : (rank + 1) * ROWS]
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        for hook in hooks if step == 0 else ():
            hook.remove()
    return losses, seen


def check_param_dtype_override(source: str) -> dict[str, Any]:
    """Norms kept in fp32 inside bf16 groups: through fully_shard's argument (any torch) or
    torch 2.15's MixedPrecisionPolicy field. Equal to the norms in fp32 groups of their own
    (the same arithmetic), and to FSDP2 with the same policy where torch has the field."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    has_field = "param_dtype_override_fn" in MixedPrecisionPolicy.__dataclass_fields__
    in_policy = (
        MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            param_dtype_override_fn=_keep_norms,
        )
        if has_field
        else None
    )

    def overridden(model: nn.Module) -> None:
        for layer in model:
            if source == "policy":
                fully_shard(layer, mesh=mesh, mp_policy=in_policy)
            else:
                fully_shard(layer, mesh=mesh, mp_policy=bf16, param_dtype_override_fn=_keep_norms)
            assert len(layer._fsdp_engine_state.group.buffers) == 2  # one gather per dtype
        fully_shard(model, mesh=mesh, mp_policy=bf16)

    def separate(model: nn.Module) -> None:
        for layer in model:
            fully_shard(layer.norm, mesh=mesh)  # fp32, no casts
            fully_shard(layer, mesh=mesh, mp_policy=bf16)
        fully_shard(model, mesh=mesh, mp_policy=bf16)

    losses, seen = _train_norm_model(overridden)
    assert len(seen) == 6, seen  # 2 blocks x (up, norm, down)
    for name, dtype in seen.items():
        kept = name.endswith("norm.weight")
        assert dtype == (torch.float32 if kept else torch.bfloat16), (name, dtype)
    apart, _ = _train_norm_model(separate)
    torch.testing.assert_close(losses, apart, rtol=1e-5, atol=0)
    result: dict[str, Any] = {"ours": losses, "apart": apart}
    if has_field:

        def torch_overridden(model: nn.Module) -> None:
            for layer in model:
                torch_fully_shard(layer, mesh=mesh, mp_policy=in_policy)
            torch_fully_shard(model, mesh=mesh, mp_policy=bf16)

        result["fsdp2"], theirs_seen = _train_norm_model(torch_overridden)
        assert theirs_seen == seen, (theirs_seen, seen)
        # The same bf16 arithmetic; the gradients' fp32 sums may round in another order, which
        # moves a bf16 weight by at most an ulp (2**-8 relative) per step: two of them.
        torch.testing.assert_close(losses, result["fsdp2"], rtol=2 * 2**-8, atol=0)
    return result


def check_param_dtype_override_bad_input() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for fn, error, match in [
        (lambda p: torch.float16, ValueError, r"returned torch.float16 for 'weight'"),
        (lambda p: torch.int32, ValueError, r"returned torch.int32 for 'weight'"),
        (lambda p: "fp32", ValueError, r"must return a torch.dtype or None; for 'weight'"),
        ("fp32", TypeError, "param_dtype_override_fn must be callable"),
    ]:
        expect_error(
            error,
            lambda fn=fn: fully_shard(
                nn.Linear(4, 4), mesh=mesh, mp_policy=bf16, param_dtype_override_fn=fn
            ),
            match,
        )
    if "param_dtype_override_fn" in MixedPrecisionPolicy.__dataclass_fields__:
        both = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=_keep_norms)
        expect_error(
            ValueError,
            lambda: fully_shard(
                nn.Linear(4, 4), mesh=mesh, mp_policy=both, param_dtype_override_fn=_keep_norms
            ),
            "both as its argument and in mp_policy",
        )
