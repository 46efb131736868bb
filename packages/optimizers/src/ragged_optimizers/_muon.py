"""Muon on sharded parameters: one owner per matrix gathers it, orthogonalizes it, sends it back.

A step, per process group of the shard axis:
1. Every rank updates the momentum of its own pieces (elementwise, no communication).
2. Same-shape matrices of a param group are taken together, in parameter order, up to
   `ns_batch_numel` elements at a time (a "unit": one batched Newton-Schulz, one launch per op
   for all of them); one owner per unit, from `plan_owners` (the same plan on every rank, no
   communication). Units depend on shapes, order and the number of owners alone: a shape's
   matrices are batched only as far as every owner still gets a unit.
3. Per bucket of units, one all-to-all with uneven splits sends each piece of each matrix to
   its owner, in bfloat16 (Newton-Schulz runs in bfloat16, and the cast is elementwise, so the
   owner's matrix is bitwise the single-process one). All buckets are posted at once; the
   owner orthogonalizes a bucket's units as soon as that bucket has arrived.
4. One all-to-all per bucket sends every rank its piece of each update, which it applies.
A rank never holds a whole matrix it does not own, and what it sends is exactly the part of
each matrix the owner lacks, once in each direction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ragged_optimizers._adamw import adamw_step, check_betas, check_nonnegative
from ragged_optimizers._compat import foreach_add_
from ragged_optimizers._layout import ParamLayout, layout_of, local_flat
from ragged_optimizers._muon_exchange import (
    Item,
    Unit,
    agree,
    assemble,
    buckets,
    by_process_group,
    make_units,
    matrix_shape,
    plan_units,
    send_back,
    send_to_owners,
    tp_size,
)
from ragged_optimizers._muon_momentum import momentum_runs, step_momenta
from ragged_optimizers._muon_replicas import (
    Replicas,
    common_replicas,
    plan_over_replicas,
    replicas_of,
    share_updates,
)
from ragged_optimizers._newton_schulz import newton_schulz, resolve_coefficients
from ragged_optimizers._owner_plan import MatrixAssignment, OwnerPlan, ns_flops
from ragged_optimizers._per_head import check_heads, join_heads, split_heads
from ragged_optimizers._runs import GroupRuns
from ragged_optimizers._step import StepOptimizer
from ragged_optimizers._tensor_parallel import orthogonalize_on_one_rank

ADJUST_LR = ("original", "match_rms_adamw")


def adjusted_lr(lr: float, adjust_lr: str, shape: Sequence[int]) -> float:
    """The learning rate scaled for one matrix's shape (rows, cols are its last two dims).

    Example:
        >>> adjusted_lr(0.02, "original", (1024, 256))  # sqrt(max(1, rows / cols)) = 2
        0.04
    """
    rows, cols = matrix_shape(shape)[-2:]
    if adjust_lr == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(StepOptimizer):
    """Muon (momentum orthogonalized by Newton-Schulz) with AdamW groups, on sharded parameters.

    Parameters may be plain tensors (one process), RaggedShard DTensors (DBuffer, fsdp_engine)
    or Shard(0) DTensors (FSDP2); other mesh axes must be Replicate, or, beside a RaggedShard,
    Shard(d) of tensor / expert parallelism. Each matrix sharded over several ranks is
    orthogonalized by one owner (see `owner_plan`): under HSDP and for tp-Replicate
    matrices, once in the mesh where that pays and once per replica elsewhere
    (`replica_owners`); a tp-split matrix's owner is a (dp rank, tp rank) slot that gathers
    its blocks (`tp_owners`).

    Non-finite gradients are not filtered (as in torch.optim.Muon): a NaN or Inf anywhere in
    a matrix's gradient makes its whole update NaN, on every rank alike. Stop on them with
    `clip_grad_norm_(..., error_if_nonfinite=True)`.

    Attributes:
        exchange_time: The last step's host time in the owner exchange: "wait_s" waiting
            for buckets of pieces, "orthogonalize_s" orthogonalizing them, "buckets".

    Args:
        params: Parameters, named parameters or param groups. A group with
            `use_muon=False` is updated with AdamW (use it for embeddings, the output head,
            norms and biases, which shape alone cannot tell apart). A group with
            `num_heads=H` is orthogonalized per head (Kimi K2's per-head Muon): each
            matrix's H blocks along `heads_dim` (0: rows, for q, k and v projections; 1:
            columns, for the output projection) go through Newton-Schulz separately, and
            the lr is adjusted for a head's shape.
        lr: Muon learning rate.
        momentum: Momentum (EMA form: buf = momentum * buf + (1 - momentum) * grad).
        nesterov: Orthogonalize lerp(grad, buf, momentum) instead of buf.
        ns_steps: Newton-Schulz steps.
        ns_coefficients: "keller", "polar_express" or (a, b, c) triples (one, or one per step).
        weight_decay: Decoupled weight decay with the base lr: p *= 1 - lr * weight_decay.
        adjust_lr: "original" (lr * sqrt(max(1, rows / cols))) or "match_rms_adamw"
            (lr * 0.2 * sqrt(max(rows, cols))).
        eps: Lower bound of the norm the matrix is divided by.
        adamw_lr: AdamW groups' learning rate: their "lr" unless they set one, so learning
            rate schedulers scale it like every other group's.
        adamw_betas: AdamW groups' betas.
        adamw_eps: AdamW groups' eps.
        adamw_weight_decay: AdamW groups' decoupled weight decay.
        bucket_bytes: Matrices travel in buckets of about this many bfloat16 bytes, one
            all-to-all each way per bucket; owners start on a bucket as soon as it arrives.
        replica_owners: Under HSDP (a replicate axis beside the shard axis), True
            orthogonalizes each matrix once in the whole mesh: owners are planned over
            replicate x shard ranks and one all-gather over the replicate axis brings each
            rank the updates the other replicas computed (bfloat16, (R - 1) / R of its
            pieces). False: every replica orthogonalizes every matrix (no bytes over the
            replicate axis). "auto": priced per matrix (or batch): once in the mesh when its
            Newton-Schulz FLOPs are at least `replica_flops_per_byte` x the bytes of its
            update, else in every replica.
        replica_flops_per_byte: The compute rate of Newton-Schulz over the replicate axis'
            bandwidth per rank, for "auto": 2048 is about 100 TFLOP/s of bfloat16 matmuls
            on the mid-size matrices where the choice matters against 50 GB/s per GPU
            between nodes; with 5 steps it shares square matrices from 137 rows up (an
            n x n matrix costs 15 n FLOPs per byte of its update).
        tp_owners: Under tensor parallelism, one tp rank (in turn) orthogonalizes each
            matrix and scatters its blocks, instead of every tp rank gathering and
            orthogonalizing it.
        ns_batch_numel: Same-shape 2-D matrices of a group (in parameter order) are
            orthogonalized together, as one batched Newton-Schulz, while the batch holds at
            most this many elements: many small matrices (an MoE's experts) cost one launch
            per op instead of one per matrix, while large ones, whose products are long
            enough to hide their launches, go alone and spread over the owners. Batched
            products round differently from single ones, so 1 (no batching) gives
            torch.optim.Muon's results bit for bit. A shape's matrices are batched only as
            far as every owner still gets a batch (8 equal matrices on 4 ranks: 4 batches
            of 2), so with batching on, results may differ in the last bits between world
            sizes.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> opt = Muon([{"params": [model[0].weight]},
        ...             {"params": [model[0].bias, *model[1].parameters()], "use_muon": False}])
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "keller",
        weight_decay: float = 0.0,
        adjust_lr: str = "original",
        eps: float = 1e-7,
        *,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float = 0.0,
        bucket_bytes: int = 32 * 2**20,
        ns_batch_numel: int = 2**22,
        replica_owners: bool | str = "auto",
        replica_flops_per_byte: float = 2048.0,
        tp_owners: bool = True,
    ) -> None:
        if not isinstance(tp_owners, bool):
            raise TypeError(f"tp_owners must be a bool, got {tp_owners!r}")
        self._tp_owners = tp_owners
        self._tp_turn = 0  # which tp rank orthogonalizes the next tensor-parallel unit
        if not isinstance(replica_owners, bool) and replica_owners != "auto":
            raise ValueError(
                f"replica_owners must be True, False or 'auto', got {replica_owners!r}"
            )
        rate: object = replica_flops_per_byte  # user input: check what came
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not (0 <= replica_flops_per_byte < math.inf)
        ):
            raise ValueError(
                f"replica_flops_per_byte must be a finite number >= 0, got "
                f"{replica_flops_per_byte!r}"
            )
        self._replica_owners = replica_owners
        self._replica_flops_per_byte = float(replica_flops_per_byte)
        for key, value in (("bucket_bytes", bucket_bytes), ("ns_batch_numel", ns_batch_numel)):
            given: object = value  # user input: check what came
            if isinstance(given, bool) or not isinstance(given, int) or given < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        self._bucket_bytes = bucket_bytes
        self._ns_batch_numel = ns_batch_numel
        self._layouts: dict[int, ParamLayout] = {}
        self._param_names: dict[int, str] = {}
        self._runs: dict[int, GroupRuns] = {}  # by id of the param group
        # The last step's host time waiting for buckets of pieces vs orthogonalizing them
        # (measured on the host: a CUDA collective's wait returns before its data lands).
        self.exchange_time: dict[str, float] = {}
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
            "weight_decay": weight_decay,
            "adjust_lr": adjust_lr,
            "eps": eps,
            "use_muon": True,
            "num_heads": None,
            "heads_dim": 0,
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group (checked: hyper-parameters and, for Muon groups, shapes)."""
        if not param_group.get("use_muon", True) and "lr" not in param_group:
            # An AdamW group's learning rate is its "lr", so schedulers scale it too.
            param_group = {
                **param_group,
                "lr": param_group.get("adamw_lr", self.defaults["adamw_lr"]),
            }
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names") or [
            f"params[{len(self._param_names) + i}]" for i in range(len(group["params"]))
        ]
        self._param_names.update(
            (id(param), name) for param, name in zip(group["params"], names, strict=True)
        )
        for key in ("lr", "weight_decay", "adamw_lr", "adamw_weight_decay"):
            check_nonnegative(group[key], key)
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum: {group['momentum']!r} (must be in [0, 1))")
        if not group["eps"] > 0.0 or not group["adamw_eps"] >= 0.0:
            raise ValueError(
                f"Invalid eps: {group['eps']!r} / adamw_eps {group['adamw_eps']!r} (eps > 0, "
                f"adamw_eps >= 0)"
            )
        if group["adjust_lr"] not in ADJUST_LR:
            raise ValueError(
                f"unknown adjust_lr {group['adjust_lr']!r}; valid: {', '.join(ADJUST_LR)}"
            )
        group["adamw_betas"] = check_betas(group["adamw_betas"], "adamw_betas")
        resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        if group["use_muon"]:
            for param, name in zip(group["params"], self._names(group), strict=True):
                if param.ndim not in (2, 3, 4):
                    raise ValueError(
                        f"Muon group holds {name} of shape {tuple(param.shape)}: Muon "
                        f"orthogonalizes 2-D matrices (3-D: a stack, 4-D: flattened to "
                        f"(out, rest)); put it in a group with use_muon=False (AdamW)"
                    )
                if group["num_heads"] is not None:
                    check_heads(name, param.shape, group["num_heads"], group["heads_dim"])

    def _names(self, group: dict[str, Any]) -> list[str]:
        return [self._param_names[id(param)] for param in group["params"]]

    def _layout(self, param: torch.Tensor, name: str) -> ParamLayout:
        layout = self._layouts.get(id(param))
        if layout is None:
            layout = self._layouts[id(param)] = layout_of(param, name)
        return layout

    # -- the plan -----------------------------------------------------------------------------

    def _sharded(self) -> list[Item]:
        out = []
        for group in self.param_groups:
            if group["use_muon"]:
                for param, name in zip(group["params"], self._names(group), strict=True):
                    layout = self._layout(param, name)
                    if layout.num_ranks > 1:
                        out.append(Item(param, name, layout, torch.empty(0), group))
        return out

    def owner_plan(self) -> OwnerPlan:
        """The owner of every sharded Muon matrix, its FLOPs and the elements moved per step.

        Computed from shapes and placements alone, so every rank returns the same plan.
        Matrices batched together (see `ns_batch_numel`) share an owner. Under HSDP the slots
        are the replicate x shard ranks: replica slot // W, shard rank slot % W; a matrix
        every replica orthogonalizes (see `replica_owners`) has `num_copies` R. Elements
        travel in bfloat16 (2 bytes each way). Matrices that are not sharded (plain
        tensors, replicated DTensors, one-rank meshes) are not listed: every rank updates
        them. Printed, the plan states its makespan against the lower bound.

        Returns:
            An OwnerPlan: one MatrixAssignment per sharded matrix, in parameter order.

        Example:
            >>> print(Muon([torch.nn.Parameter(torch.zeros(4, 4))]).owner_plan())  # one process
            OwnerPlan: no sharded matrix
        """
        sharded = self._sharded()
        ns_steps = max((g["ns_steps"] for g in self.param_groups), default=5)
        owners: dict[int, tuple[int, int, int]] = {}  # item -> (slot, shard owner, copies)
        num_slots = 0
        for members in by_process_group(sharded):
            world = members[0].layout.num_ranks
            for items, replicas, num_tp in self._exchange_groups(members):
                mesh_replicas = common_replicas([item.layout for item in items])
                copies = 1 if replicas is not None or mesh_replicas is None else mesh_replicas.size
                if replicas is None:  # as `_exchange` plans them
                    units = make_units(items, self._ns_batch_numel, world * num_tp)
                    plan_units(units, ns_steps, num_tp)
                    num_slots = max(num_slots, world * num_tp * copies)
                    for unit in units:
                        slot = (unit.tp_rank or 0) * world + unit.owner
                        owners.update((id(item), (slot, unit.owner, copies)) for item in unit.items)
                    continue
                num_slots = max(num_slots, world * replicas.size)
                units = make_units(items, self._ns_batch_numel, world * replicas.size)
                replica_of = plan_over_replicas(units, replicas.size, ns_steps, self._price())
                for unit, replica in zip(units, replica_of, strict=True):
                    if replica is None:
                        where = (unit.owner, unit.owner, replicas.size)
                    else:
                        where = (replica * world + unit.owner, unit.owner, 1)
                    owners.update((id(item), where) for item in unit.items)
        out = []
        for index, item in enumerate(sharded):
            shape = matrix_shape(item.layout.full_shape)
            pieces = [hi - lo for lo, hi in item.layout.ranges]
            slot, on_axis, copies = owners[id(item)]
            moved = sum(pieces) - pieces[on_axis]
            flops = ns_flops(shape, ns_steps)
            out.append(MatrixAssignment(index, item.name, shape, slot, flops, moved, moved, copies))
        return OwnerPlan(tuple(out), num_slots)

    # -- the step -----------------------------------------------------------------------------

    def _step(self) -> None:
        """One step on the current gradients (`step` runs the closure first, then this)."""
        self.exchange_time = {"wait_s": 0.0, "orthogonalize_s": 0.0, "buckets": 0}
        sharded: list[Item] = []
        local: list[Item] = []
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw(group)
                continue
            for param, name in zip(group["params"], self._names(group), strict=True):
                layout = self._layout(param, name)
                if layout.num_ranks > 1:
                    # Sharded matrices join the exchange even without a gradient; they are
                    # filtered once all ranks agree (see agree).
                    sharded.append(Item(param, name, layout, torch.empty(0), group))
                elif param.grad is not None:
                    local.append(Item(param, name, layout, torch.empty(0), group))
        kept = agree(sharded) if sharded else []  # every rank the same matrices, or an error
        inputs: dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            if group["use_muon"]:
                inputs.update(self._momenta(group))
        for unit in make_units(local, self._ns_batch_numel):
            updates = self._orthogonalize_unit(unit, [inputs[id(i.param)] for i in unit.items])
            self._apply_unit(unit, updates)
        for members in by_process_group(kept):
            for item in members:
                item.update = inputs[id(item.param)]
            owners = members[0].layout.num_ranks
            for items, replicas, num_tp in self._exchange_groups(members):
                if replicas is not None:
                    self._exchange_over_replicas(items, replicas)
                else:
                    units = make_units(items, self._ns_batch_numel, owners * num_tp)
                    self._exchange(units, num_tp=num_tp)

    def _momenta(self, group: dict[str, Any]) -> dict[int, torch.Tensor]:
        """Steps a Muon group's momentum and weight decay per run; the Newton-Schulz inputs.

        Only parameters with a gradient, one tensor per run (`_muon_momentum.py`).
        """
        runs = self._runs.get(id(group))
        if runs is None or not runs.is_current(group["params"]):
            runs = self._runs[id(group)] = momentum_runs(group["params"], self.state, self._name)
        return step_momenta(runs, group, self.state)

    def _name(self, param: torch.Tensor) -> str:
        return self._param_names.get(id(param), "a parameter")

    def _state_changed(self) -> None:
        """Entries were edited or loaded: the runs re-read them at their next step."""
        self._runs.clear()

    def _apply_unit(self, unit: Unit, updates: list[torch.Tensor]) -> None:
        """Adds each matrix's (local piece of its) update: the same lr for the whole unit.

        Weight decay came first, in `_momenta`.
        """
        group = unit.group
        locals_ = [local_flat(item.param) for item in unit.items]
        # A head's (rows, cols) in per-head groups: Newton-Schulz's last two dims.
        lr = adjusted_lr(group["lr"], group["adjust_lr"], unit.shape)
        foreach_add_(locals_, updates, alpha=-lr)

    def _orthogonalize_unit(self, unit: Unit, fulls: list[torch.Tensor]) -> list[torch.Tensor]:
        """The flat orthogonalized update of each of a unit's matrices (full, flat inputs).

        Under tensor parallelism `fulls` are this rank's blocks: with `tp_owners` one tp rank
        (in turn, unit by unit) gathers the whole matrices, orthogonalizes them and scatters
        the blocks (`_tensor_parallel.py`); otherwise every tp rank gathers and computes.
        """
        coefficients, norm_scale = resolve_coefficients(
            unit.group["ns_coefficients"], unit.group["ns_steps"]
        )
        layout = unit.layout

        num_heads, heads_dim = unit.heads

        def orthogonalize(stack: torch.Tensor) -> torch.Tensor:
            whole = stack.view(unit.stack_shape)
            matrices = whole if num_heads is None else split_heads(whole, num_heads, heads_dim)
            out = newton_schulz(
                matrices, coefficients, eps=unit.group["eps"], norm_scale=norm_scale
            )
            if num_heads is not None:
                out = join_heads(out, whole.shape, num_heads, heads_dim)
            return out.reshape(len(fulls), -1)

        split = layout.tensor_parallel() if self._tp_owners else None
        if split is not None:
            tp_rank = unit.tp_rank
            if tp_rank is None:  # not planned over tp (no dp axis): tp ranks take turns
                assert layout.mesh is not None
                self._tp_turn += 1
                tp_rank = (self._tp_turn + layout.rank) % layout.mesh.size(split[0])
            return orthogonalize_on_one_rank(layout, split, fulls, orthogonalize, tp_rank)
        stack = layout.gather_blocks(fulls)  # one collective for the unit
        return list(layout.take_blocks(orthogonalize(stack)).unbind())

    def _exchange(
        self, units: list[Unit], *, plan: bool = True, apply: bool = True, num_tp: int = 1
    ) -> dict[int, list[torch.Tensor]]:
        """Gathers each unit to its owner, orthogonalizes it, sends every rank its pieces.

        Returns each unit's pieces of its update on this rank (by unit id); with `apply`
        they are applied too. `plan=False`: the units' owners are set already. `num_tp`:
        plan over dp owner x tp rank slots (see `plan_units`).
        """
        done: dict[int, list[torch.Tensor]] = {}
        if not units:
            return done
        layout0 = units[0].layout
        process_group, me, world = layout0.group, layout0.rank, layout0.num_ranks
        assert process_group is not None
        if plan:
            plan_units(units, max(unit.group["ns_steps"] for unit in units), num_tp)
        bucket_list = buckets(units, self._bucket_bytes)
        inbound = [send_to_owners(bucket, me, world, process_group) for bucket in bucket_list]
        outbound = []
        clock = self.exchange_time
        for bucket, (received, work) in zip(bucket_list, inbound, strict=True):
            start = time.perf_counter()
            work.wait()
            waited = time.perf_counter()
            updates = {}
            for unit, fulls in assemble(bucket, received, me, world):
                updates[id(unit)] = self._orthogonalize_unit(unit, fulls)
            clock["wait_s"] += waited - start
            clock["orthogonalize_s"] += time.perf_counter() - waited
            clock["buckets"] += 1
            outbound.append(send_back(bucket, updates, me, world, process_group))
        for bucket, (received, work) in zip(bucket_list, outbound, strict=True):
            work.wait()
            offset = 0
            for src in range(world):
                for unit in bucket:
                    if unit.owner != src:
                        continue
                    pieces = []
                    for item in unit.items:
                        lo, hi = item.layout.local_range
                        pieces.append(received[offset : offset + hi - lo])
                        offset += hi - lo
                    done[id(unit)] = pieces
                    if apply:
                        self._apply_unit(unit, pieces)
        return done

    def _exchange_groups(
        self, members: list[Item]
    ) -> list[tuple[list[Item], Replicas | None, int]]:
        """One shard group's matrices by how they are exchanged, in an order every rank shares.

        Matrices replicated over another axis (HSDP's replicate axis, or the tp axis for a
        tp-Replicate matrix) are planned over that axis too, one list per axis; the rest
        (the replica_owners=False case included) per shard group, with the tp ranks as
        slots when tensor parallelism splits all of them alike. Each entry: (matrices, the
        replicate axis owners span or None, tp slots per dp owner).
        """
        shared: dict[int, tuple[list[Item], Replicas]] = {}
        rest: list[Item] = []
        for item in members:
            replicas = None if self._replica_owners is False else replicas_of(item.layout)
            if replicas is None:
                rest.append(item)
            else:
                shared.setdefault(id(replicas.group), ([], replicas))[0].append(item)
        out: list[tuple[list[Item], Replicas | None, int]] = [
            (items, replicas, 1) for items, replicas in shared.values()
        ]
        if rest:
            sizes = {tp_size(Unit([item])) for item in rest} if self._tp_owners else {1}
            out.append((rest, None, sizes.pop() if len(sizes) == 1 else 1))
        return out

    def _price(self) -> float | None:
        """`worth_sharing`'s FLOPs per byte; None shares every unit (`replica_owners=True`)."""
        return self._replica_flops_per_byte if self._replica_owners == "auto" else None

    def _exchange_over_replicas(self, members: list[Item], replicas: Replicas) -> None:
        """`_exchange` with owners over replicate x shard ranks (`_muon_replicas.py`).

        This replica computes its own units and those every replica computes; one
        all-gather over the replicate axis brings the other replicas' units.
        """
        world = members[0].layout.num_ranks
        units = make_units(members, self._ns_batch_numel, world * replicas.size)
        ns_steps = max(unit.group["ns_steps"] for unit in units)
        replica_of = plan_over_replicas(units, replicas.size, ns_steps, self._price())
        mine = [u for u, r in zip(units, replica_of, strict=True) if r in (None, replicas.rank)]
        computed = self._exchange(mine, plan=False, apply=False)
        once = [(u, r) for u, r in zip(units, replica_of, strict=True) if r is not None]
        if once:
            units_once, replicas_once = map(list, zip(*once, strict=True))
            computed.update(share_updates(units_once, replicas_once, computed, replicas))
        for unit in units:
            self._apply_unit(unit, computed[id(unit)])

    def _adamw(self, group: dict[str, Any]) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "step" not in state:
                layout = self._layout(param, "")
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = layout.wrap(torch.zeros_like(local_flat(param)), param)
                state["exp_avg_sq"] = layout.wrap(torch.zeros_like(local_flat(param)), param)
            state["step"] += 1
            adamw_step(
                local_flat(param),
                local_flat(param.grad),
                local_flat(state["exp_avg"]),
                local_flat(state["exp_avg_sq"]),
                step=int(state["step"].item()),
                lr=group["lr"],
                betas=group["adamw_betas"],
                eps=group["adamw_eps"],
                weight_decay=group["adamw_weight_decay"],
            )
