"""fully_shard over tensor- and expert-parallel DTensors, run on every rank of a RankPool.

The model is torch's own DTensor test Transformer, parallelized with torch's `ColwiseParallel`,
`RowwiseParallel`, `SequenceParallel` and `PrepareModuleInput` (its `parallelize`), then
sharded over the data-parallel axes by ours and, on a copy, by FSDP2. Every data-parallel rank
trains on its own rows of each batch (the tensor-parallel ranks of one replica on the same
rows); one process trains the unparallelized model on the whole batch. Losses and full
parameters must agree.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from engine_checkpoint_cases import full_state
from low_precision import assert_as_accurate
from parallel import gather_rows, sum_and_take_rows
from rank_pool import expect_error
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from fsdp_engine import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from ragged_placement import RaggedShard, chunk_range, flat_range, local_view

ROWS_PER_REPLICA = 2
# Every size divides by 2, 3 and 4: each tensor-parallel split is even (a requirement, tested
# in check_bad_input), while the data-parallel shards of the local pieces are uneven.
ARGS = ModelArgs(
    n_layers=2, vocab_size=24, max_seq_len=12, dim=48, n_heads=12, dropout_p=0.0,
    weight_tying=False,
)  # fmt: skip
SEQ = 12


def make_mesh(shape: tuple[int, ...]) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(whole mesh, data-parallel mesh, tensor-parallel mesh) for (dp, tp) or (rep, shard, tp)."""
    if len(shape) == 2:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return mesh, mesh["dp"], mesh["tp"]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    return mesh, mesh["replicate", "shard"], mesh["tp"]


def _model(dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS).to(dtype)


def _parallelize(
    model: Transformer,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh,
    *,
    engine: str,
    seq_parallel: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: bool = False,
) -> None:
    # Local attention outputs: CPU's fused attention has no DTensor sharding rule.
    Transformer.parallelize(model, tp_mesh, seq_parallel, True)
    shard: Callable[..., Any] = fully_shard if engine == "ours" else torch_fully_shard
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload:  # FSDP2 cannot pin without an accelerator
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=engine == "ours")
    for layer in model.layers:
        shard(layer, **kwargs)
    shard(model, **kwargs)


def _batches(steps: int, num_replicas: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, ARGS.vocab_size, (num_replicas * ROWS_PER_REPLICA, SEQ), generator=gen)
        for _ in range(steps)
    ]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )


def _train(
    model: nn.Module,
    batches: list[torch.Tensor],
    *,
    replica: int | None,
    clip: bool,
    optimizer: str = "adamw",
    grads: list[dict[str, torch.Tensor]] | None = None,
) -> list[float]:
    """Optimizer steps; `replica`: this rank's data-parallel index (None: one process, all rows).

    `optimizer`: "adamw", or "sgd" (linear in the gradient: for bf16, see low_precision).
    `grads`: if given, each step's full gradients (before clipping) are appended to it.
    """
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.1)
    losses = []
    for batch in batches:
        rows = batch
        if replica is not None:
            rows = batch[replica * ROWS_PER_REPLICA : (replica + 1) * ROWS_PER_REPLICA]
        loss = _loss(model, rows)
        loss.backward()
        if grads is not None:
            grads.append(_full_grads(model))
        if clip:
            clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        value = loss.detach().double()
        if replica is not None:  # the mean over ranks (so over replicas): the batch's loss
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grad = param.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    return grads


def _first_grads(model: nn.Module, batch: torch.Tensor, replica: int | None) -> dict[str, Any]:
    """The full gradients of one backward on `batch` (this replica's rows), then zeroed."""
    rows = batch
    if replica is not None:
        rows = batch[replica * ROWS_PER_REPLICA : (replica + 1) * ROWS_PER_REPLICA]
    _loss(model, rows).backward()
    grads = _full_grads(model)
    model.zero_grad()
    return grads


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }


def _replica(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's data-parallel index and the number of data-parallel replicas."""
    dp_axes = range(mesh.ndim - 1)
    sizes = [mesh.size(a) for a in dp_axes]
    index = 0
    for axis in dp_axes:
        index = index * mesh.size(axis) + mesh.get_local_rank(axis)
    return index, math.prod(sizes)


def check_training(shape: tuple[int, ...], seq_parallel: bool, precision: str) -> dict[str, Any]:
    """Ours on a (dp, tp) or (replicate, shard, tp) mesh against one process and FSDP2.

    `precision`: "fp64" (exact comparisons), "fp32", or "bf16" (bf16 parameters, fp32
    reduce; by accuracy against the fp32 one-process run, see `_check_bf16`); "+offload":
    both engines with CPUOffloadPolicy.
    """
    precision, _, offloaded = precision.partition("+")
    offload = offloaded == "offload"
    if precision == "bf16":
        return _check_bf16(shape, seq_parallel)
    mesh, dp_mesh, tp_mesh = make_mesh(shape)
    replica, num_replicas = _replica(mesh)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    batches = _batches(3, num_replicas)
    base = _model(dtype)
    reference, theirs, ours = copy.deepcopy(base), copy.deepcopy(base), base
    # Without sequence parallelism the norms' weights are over dp alone, the rest over
    # (dp, tp): torch's clip_grad_norm_ refuses that mix (for FSDP2 too), ours takes it.
    clip = True
    _parallelize(ours, dp_mesh, tp_mesh, engine="ours", seq_parallel=seq_parallel, offload=offload)
    _assert_placements(ours, mesh)
    # AdamW hides a gradient's scale: compare the first step's gradients themselves.
    ours_grads = _first_grads(ours, batches[0], replica)
    ours_losses = _train(ours, batches, replica=replica, clip=clip)
    ours_params = _full_params(ours)
    result: dict[str, Any] = {"ours": ours_losses}
    # The Transformer returns float32 logits (`.float()`) whatever its dtype, so even in
    # float64 one process differs from the ranks by float32 rounding of the loss (gradients
    # 1e-10 apart, measured); AdamW turns that into up to 3e-7 on an element whose gradient
    # is near its eps. FSDP2 runs the ranks' arithmetic: against it fp64 is exact.
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    if precision == "fp32":
        tolerance = {"atol": 2e-4, "rtol": 1e-3}
    for name, value in _first_grads(reference, batches[0], None).items():
        torch.testing.assert_close(
            ours_grads[name].to(value.dtype), value,
            msg=lambda m, n=name: f"grad {n}: {m}", **tolerance,
        )  # fmt: skip
    ref_losses = _train(reference, batches, replica=None, clip=clip)
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(ref_losses), **tolerance)
    for name, value in _full_params(reference).items():
        torch.testing.assert_close(
            ours_params[name].to(value.dtype), value,
            msg=lambda m, n=name: f"{n}: {m}", **tolerance,
        )  # fmt: skip
    result["reference"] = ref_losses
    _parallelize(
        theirs, dp_mesh, tp_mesh, engine="fsdp2", seq_parallel=seq_parallel, offload=offload
    )
    fsdp2_grads = _first_grads(theirs, batches[0], replica)
    fsdp2_losses = _train(theirs, batches, replica=replica, clip=clip)
    close: dict[str, float] = {} if precision == "fp64" else tolerance
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(fsdp2_losses), **close)
    for name, value in fsdp2_grads.items():
        torch.testing.assert_close(
            ours_grads[name], value, msg=lambda m, n=name: f"grad {n}: {m}", **close
        )
    fsdp2_params = _full_params(theirs)
    for name, value in fsdp2_params.items():
        torch.testing.assert_close(
            ours_params[name], value, msg=lambda m, n=name: f"{n}: {m}", **close
        )
    result["fsdp2"] = fsdp2_losses
    # The largest differences (`pytest -s` prints them).
    result["record"] = {
        "params vs fsdp2": _max_diff(ours_params, fsdp2_params),
        "grads vs fsdp2": _max_diff(ours_grads, fsdp2_grads),
        "params vs one process": _max_diff(ours_params, _full_params(reference)),
    }
    return result


def _assert_placements(model: nn.Module, mesh: DeviceMesh) -> None:
    """One RaggedShard per parameter; tensor-parallel ones on the dp axes, then tp's."""
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        ragged = [p for p in param.placements if isinstance(p, RaggedShard)]
        assert len(ragged) == 1 or param.to_local().numel() == 0, (name, param.placements)
        if param.device_mesh.ndim == mesh.ndim:
            assert param.device_mesh.mesh_dim_names == mesh.mesh_dim_names, name


def _check_bf16(shape: tuple[int, ...], seq_parallel: bool) -> dict[str, Any]:
    """bf16 parameters, fp32 reduce: ours as accurate as FSDP2 against fp32 (low_precision).

    Every step's gradients, the losses and the final parameters of ours and of FSDP2 are held
    against one process in fp32 on the whole batch, with SGD (linear in the gradient, so
    bf16 rounding noise is not amplified; AdamW's normalisation is covered in fp32 and fp64).
    """
    mesh, dp_mesh, tp_mesh = make_mesh(shape)
    replica, num_replicas = _replica(mesh)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = _batches(3, num_replicas)
    base = _model(torch.float32)
    start = {name: p.detach().clone() for name, p in base.named_parameters()}
    runs: dict[str, Any] = {}
    for engine in ("ours", "fsdp2", "one process"):
        model = copy.deepcopy(base)
        if engine != "one process":
            _parallelize(
                model, dp_mesh, tp_mesh, engine=engine, seq_parallel=seq_parallel, mp_policy=mp
            )
        if engine == "ours":
            _assert_placements(model, mesh)
        grads: list[dict[str, torch.Tensor]] = []
        losses = _train(
            model, batches, replica=None if engine == "one process" else replica,
            clip=True, optimizer="sgd", grads=grads,
        )  # fmt: skip
        runs[engine] = {"grads": grads, "losses": losses, "params": _full_params(model)}
    ours, fsdp2, exact = runs["ours"], runs["fsdp2"], runs["one process"]
    ratios = {}
    for step, grads in enumerate(exact["grads"]):
        ratios[f"grads {step + 1}"] = assert_as_accurate(
            ours["grads"][step], fsdp2["grads"][step], grads, what=f"step {step + 1} gradient"
        )
    ratios["losses"] = assert_as_accurate(
        {"loss": torch.tensor(ours["losses"])}, {"loss": torch.tensor(fsdp2["losses"])},
        {"loss": torch.tensor(exact["losses"])}, what="losses",
    )  # fmt: skip
    ratios["params"] = assert_as_accurate(
        ours["params"], fsdp2["params"], exact["params"], start=start, what="final parameters"
    )
    # The ratios of our distance from fp32 to FSDP2's (`pytest -s` prints them).
    return {"ours": ours["losses"], "fsdp2": fsdp2["losses"], "record": ratios}


def _max_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((got[n].double() - v.double()).abs().max()) for n, v in expected.items())


def _init_weights(model: nn.Module) -> None:
    """The torchtitan flow's init after `to_empty`: every weight from the one seed."""
    torch.manual_seed(42)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def check_meta_init(shape: tuple[int, ...]) -> None:
    """Built on meta, tensor-parallel, sharded, `to_empty`, initialized: one process's values."""
    _, dp_mesh, tp_mesh = make_mesh(shape)
    with torch.device("meta"):
        model = Transformer(ARGS)
    _parallelize(model, dp_mesh, tp_mesh, engine="ours", seq_parallel=True)
    model.to_empty(device="cpu")
    _init_weights(model)
    reference = Transformer(ARGS)
    _init_weights(reference)
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and not param.is_meta, name
        assert torch.equal(param.full_tensor(), expected[name].detach()), name


# -- checkpoints across meshes -----------------------------------------------------------------


def _trained(shape: tuple[int, ...], seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    _, dp_mesh, tp_mesh = make_mesh(shape)
    torch.manual_seed(seed)
    model = Transformer(ARGS).double()
    _parallelize(model, dp_mesh, tp_mesh, engine="ours", seq_parallel=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _steps(
    model: nn.Module, opt: torch.optim.Optimizer, shape: tuple[int, ...], batches: list[Any]
) -> None:
    mesh = make_mesh(shape)[0]
    replica, _ = _replica(mesh)
    for batch in batches:
        rows = batch[replica * ROWS_PER_REPLICA : (replica + 1) * ROWS_PER_REPLICA]
        _loss(model, rows).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def check_checkpoint(directory: str, save_shape: tuple[int, ...], load_shape: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """Saved with DCP on one mesh, loaded on another: the state, then 2 more steps, equal.

    The replica count stays the same between the two meshes' runs of the 2 steps after the
    checkpoint only if the shapes have equal dp sizes; otherwise the 2 steps each run the
    whole batch split differently, which is the same arithmetic up to summation order.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    num_replicas_saved = math.prod(save_shape[:-1])
    batches = _batches(4, num_replicas_saved)
    model, opt = _trained(save_shape, seed=0)
    _steps(model, opt, save_shape, batches[:2])
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=directory)
    saved = copy.deepcopy(full_state(model, opt))
    _steps(model, opt, save_shape, batches[2:])
    uninterrupted = copy.deepcopy(full_state(model, opt))

    loaded, load_opt = _trained(load_shape, seed=123)
    state = {
        "model": get_model_state_dict(loaded),
        "optim": get_optimizer_state_dict(loaded, load_opt),
    }
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(loaded, state["model"])
    set_optimizer_state_dict(loaded, load_opt, state["optim"])
    _assert_state(copy.deepcopy(full_state(loaded, load_opt)), saved, exact=True)
    # The same rows per step on the loading mesh: regroup each batch into its replicas.
    num_replicas_loaded = math.prod(load_shape[:-1])
    rows = ROWS_PER_REPLICA * num_replicas_saved // num_replicas_loaded
    regrouped = [b.reshape(num_replicas_loaded, rows, SEQ) for b in batches[2:]]
    mesh = make_mesh(load_shape)[0]
    replica, _ = _replica(mesh)
    for batch in regrouped:
        _loss(loaded, batch[replica]).backward()
        torch.nn.utils.clip_grad_norm_(loaded.parameters(), 1.0)
        load_opt.step()
        load_opt.zero_grad()
    _assert_state(copy.deepcopy(full_state(loaded, load_opt)), uninterrupted, exact=False)


def _assert_state(got: dict[str, Any], expected: dict[str, Any], *, exact: bool) -> None:
    if dist.get_rank() != 0:  # full state dicts live on rank 0
        return
    assert list(got["model"]) == list(expected["model"])
    for name, value in expected["model"].items():
        if exact:
            assert torch.equal(got["model"][name], value), name
        else:
            torch.testing.assert_close(got["model"][name], value, msg=name)
    for fqn, state in expected["optim"]["state"].items():
        for key, value in state.items():
            if exact:
                assert torch.equal(got["optim"]["state"][fqn][key], value), (fqn, key)
            else:
                torch.testing.assert_close(got["optim"]["state"][fqn][key], value)


# -- expert parallelism ------------------------------------------------------------------------


class FusedExperts(nn.Module):
    """Every expert on every token (a dense MoE, so one process is an exact reference).

    With an `ep` mesh the [E, ...] weights are Shard(0) DTensors over it: each rank runs its
    experts on the tokens of its whole ep group and the outputs are summed back.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden**0.5)
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):
            w1, w2 = w1.to_local(), w2.to_local()  # type: ignore[union-attr]
        if self.ep_group is not None:
            x = gather_rows(x, self.ep_group)
        hidden = torch.relu(torch.einsum("td,ehd->eth", x, w1))
        out = torch.einsum("eth,edh->td", hidden, w2)
        if self.ep_group is not None:
            out = sum_and_take_rows(out, self.ep_group)
        return out


class SeparateExperts(nn.Module):
    """The same MoE with one nn.Linear pair per expert; under EP a rank holds only its own."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(num_experts))
        self.down = nn.ModuleList(nn.Linear(hidden, dim, bias=False) for _ in range(num_experts))
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep_group is not None:
            x = gather_rows(x, self.ep_group)
        out = sum(down(torch.relu(up(x))) for up, down in zip(self.up, self.down, strict=True))
        assert isinstance(out, torch.Tensor)
        if self.ep_group is not None:
            out = sum_and_take_rows(out, self.ep_group)
        return out


class MoEModel(nn.Module):
    def __init__(self, kind: str, num_experts: int = 4, dim: int = 8, hidden: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, dim)
        cls = FusedExperts if kind == "fused" else SeparateExperts
        self.blocks = nn.ModuleList(cls(num_experts, dim, hidden) for _ in range(2))
        self.head = nn.Linear(dim, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).flatten(0, 1)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).view(*tokens.shape, -1)


def _expert_parallel(model: MoEModel, kind: str, ep_mesh: DeviceMesh) -> None:
    """Keeps this ep rank's experts: Shard(0) DTensors (fused) or its own modules (separate)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for block in model.blocks:
        block.ep_group = ep_mesh.get_group()
        if kind == "fused":
            for name in ("w1", "w2"):
                full = getattr(block, name)
                block.register_parameter(
                    name, nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)]))
                )
        else:
            per_rank = len(block.up) // ep
            keep = slice(rank * per_rank, (rank + 1) * per_rank)
            block.up = nn.ModuleList(list(block.up)[keep])
            block.down = nn.ModuleList(list(block.down)[keep])


def _local_rows(param: DTensor) -> int:
    """Rows of the block RaggedShard cuts: this rank's chunk of the other axes' Shard(0)."""
    rows = param.shape[0]
    for axis, placement in enumerate(param.placements):
        if placement == Shard(0):
            mesh = param.device_mesh
            lo, hi = chunk_range(rows, mesh.size(axis), mesh.get_local_rank(axis))
            rows = hi - lo
    return rows


def check_expert_parallel(kind: str, num_experts: int = 4) -> None:
    """4 ranks: dense parameters sharded over all 4, experts over ep=2 and dp=2 (the rest).

    Equal to one process running every expert on the whole batch; `block_rows` still holds
    inside each rank's experts. An odd `num_experts` (fused) splits them unevenly over ep.
    """
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    base = MoEModel(kind, num_experts).double()
    reference, ours = copy.deepcopy(base), base
    _expert_parallel(ours, kind, mesh["ep"])
    # Two experts per block (one when the split is uneven); 3 rows of a Linear.
    block_rows = (2 if num_experts % 2 == 0 else 1) if kind == "fused" else 3
    for block in ours.blocks:
        fully_shard(block, mesh=mesh["dp"], block_rows=block_rows)
        # Each expert's gradient sums the loss gradients of its whole ep group: divided by
        # every rank, as torchtitan does, it is the mean over the batch.
        block.set_gradient_divide_factor(float(world))  # type: ignore[operator]
    fully_shard(ours, mesh=dense_mesh)
    # The pieces keep whole blocks of the local expert tensors.
    for block in ours.blocks:
        for name, param in block.named_parameters():
            ragged = param.placements[0]
            assert isinstance(ragged, RaggedShard), (name, param.placements)
            # Piece boundaries (in rows of the local expert tensor) fall on whole blocks.
            row = math.prod(local_view(param).shape[1:])
            total_rows = _local_rows(param)
            first, end = (x // row for x in flat_range(param))
            assert first % block_rows == 0, (name, first)
            assert end % block_rows == 0 or end == total_rows, (name, end, total_rows)
            if kind == "fused":
                assert param.placements[1:] == (Shard(0),), param.placements
                assert param.device_mesh.mesh_dim_names == ("dp", "ep")
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 16, (world * 2, 5), generator=gen) for _ in range(3)]
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    rank = dist.get_rank()
    for batch in batches:
        rows = batch[2 * rank : 2 * rank + 2]
        logits = ours(rows)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), rows.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_logits = reference(batch)
        ref_loss = nn.functional.cross_entropy(ref_logits.flatten(0, 1), batch.flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach())
    ref_params = dict(reference.named_parameters())
    ep_rank, per_rank = mesh["ep"].get_local_rank(), num_experts // mesh["ep"].size()
    for name, param in ours.named_parameters():
        ref_name = name
        parts = name.split(".")  # blocks.{b}.{up|down}.{k}.weight for a separate expert
        if kind == "separate" and parts[0] == "blocks":
            # This rank's k-th expert is the reference's expert ep_rank * per_rank + k.
            parts[3] = str(ep_rank * per_rank + int(parts[3]))
            ref_name = ".".join(parts)
        torch.testing.assert_close(param.full_tensor(), ref_params[ref_name].detach(), msg=name)


# -- bad input ---------------------------------------------------------------------------------


def check_bad_input() -> None:
    """Errors that name the parameter and what would be valid."""
    mesh, dp_mesh, tp_mesh = make_mesh((dist.get_world_size() // 2, 2))
    # An uneven tensor-parallel split inside the dims a shard boundary may cut (Shard(1) of
    # experts sharded with Shard(1) over dp): their rows would be numbered differently.
    experts = nn.Module()
    uneven = distribute_tensor(torch.zeros(2, 5, 3), tp_mesh, [Shard(1)])
    experts.register_parameter("w", nn.Parameter(uneven))
    expect_error(
        ValueError,
        lambda: fully_shard(experts, mesh=dp_mesh, shard_placement_fn=lambda p: Shard(1)),
        "'w' (global shape (2, 5, 3), placements (Shard(dim=1),)) is split unevenly on a dim "
        "among dims 1..1",
    )
    # A data-parallel mesh that is not another axis of the parameters' mesh.
    other = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("other",))
    linear = nn.Linear(4, 6)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), tp_mesh, [Shard(0)]))
    expect_error(ValueError, lambda: fully_shard(linear, mesh=other), "not disjoint axes")
    linear = nn.Linear(4, 6)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), tp_mesh, [Shard(0)]))
    expect_error(ValueError, lambda: fully_shard(linear, mesh=mesh["tp"]), "not disjoint")
    # Partial DTensors hold no values of their own.
    from torch.distributed.tensor import Partial

    linear = nn.Linear(4, 6)
    weight = DTensor.from_local(linear.weight.detach(), tp_mesh, [Partial()])
    linear.weight = nn.Parameter(weight)
    expect_error(ValueError, lambda: fully_shard(linear, mesh=dp_mesh), "Partial")
    # block_rows must divide the local piece's rows (3 rows of 6 on each tp rank).
    linear = nn.Linear(4, 6)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), tp_mesh, [Shard(0)]))
    expect_error(ValueError, lambda: fully_shard(linear, mesh=dp_mesh, block_rows=2), "weight")
