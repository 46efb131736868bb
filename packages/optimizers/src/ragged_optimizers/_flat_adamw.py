"""AdamW that steps each run of adjacent parameter pieces as one tensor.

torch.optim.AdamW walks every parameter in Python each step (state lookups, list building)
and hands its kernels one tensor per parameter. On `fully_shard` a rank's pieces of a group's
parameters, and of their gradients, are adjacent views of one flat shard, so here each run of
adjacent pieces (`_runs.py`) goes to torch's own AdamW kernels (`torch.optim.adamw.adamw`,
foreach or fused) as ONE tensor: the arithmetic is torch's, element by element, so parameters
and states equal torch.optim.AdamW's with the same kernels, and the host work of a step grows
with the number of runs (a few per group), not of parameters.

The state per parameter is torch's (`step`, `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq`
with amsgrad), laid out like the parameter (a DTensor for a DTensor parameter), each tensor a
view of its run's flat state: `state_dict()` / `load_state_dict()` and
torch.distributed.checkpoint see torch's per-parameter format and load into torch's AdamW, and
torch's into this.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

from ragged_optimizers._adamw import check_betas, check_nonnegative
from ragged_optimizers._runs import GroupRuns, Run, Segment
from ragged_optimizers._step import StepOptimizer
from ragged_placement import local_pieces

_MOMENTS = ("exp_avg", "exp_avg_sq")
_MAX = "max_exp_avg_sq"
_KEYS = (*_MOMENTS, _MAX)
# The foreach kernels allocate a temporary the size of each tensor; on CPU one the size of a
# whole run (hundreds of MB) is fresh memory every step, its page faults a quarter of the step
# (47M parameters: 420 ms as one tensor, 331 ms in 4M-element chunks, 340 ms per parameter).
_CPU_FOREACH_CHUNK = 1 << 22


@functools.cache
def _torch_adamw_defaults() -> dict[str, Any]:
    """torch.optim.AdamW's param group defaults on this torch."""
    return dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults)


class AdamW(StepOptimizer):
    """torch.optim.AdamW, stepping each run of adjacent parameter pieces as one tensor.

    Same signature, defaults and results as `torch.optim.AdamW` (param groups with their own
    hyper-parameters, lr schedulers, amsgrad, maximize, foreach or fused kernels, closures,
    state dicts in torch's format). Parameters whose local pieces are adjacent views of one
    storage, with gradients that are too (`fully_shard`'s parameters and gradients, which
    are views of their group's flat shards), step together; any other parameter (a plain
    tensor, FSDP2's Shard(0) DTensor, a gradient a user replaced) steps alone, with the same
    arithmetic. Replacing `.grad` with a new tensor works but ends the coalescing for it.

    Args:
        params: Parameters, named parameters or param groups.
        lr: Learning rate.
        betas: (beta1, beta2), each in [0, 1).
        eps: Added to the bias-corrected square root of the second moment.
        weight_decay: Decoupled weight decay (p *= 1 - lr * weight_decay).
        amsgrad: Use the maximum of the second moments so far.
        maximize: Maximize the objective instead of minimizing it.
        foreach: torch's foreach kernels (None: foreach unless `fused`).
        capturable: Must be False (CUDA-graph capture is not supported).
        differentiable: Must be False (no autograd through the step).
        fused: torch's fused AdamW kernel (`_fused_adamw_`), on CPU and CUDA.

    Example:
        >>> layer = torch.nn.Linear(4, 2)
        >>> opt = AdamW(layer.parameters(), lr=0.1)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[layer.weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if capturable or differentiable:
            raise NotImplementedError(
                f"AdamW: capturable={capturable!r}, differentiable={differentiable!r}: only "
                f"False is supported; use torch.optim.AdamW for CUDA-graph capture or "
                f"autograd through the step"
            )
        if foreach and fused:
            raise ValueError("AdamW: foreach=True and fused=True cannot be set together")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "fused": fused,
            "capturable": False,
            "differentiable": False,
        }
        # Every key torch's AdamW puts in a param group on this torch (2.15:
        # `decoupled_weight_decay`): torch.distributed.checkpoint loads a group only from a
        # checkpoint that has all of the loader's keys, so the two load each other's.
        defaults = {**_torch_adamw_defaults(), **defaults}
        self._runs: dict[int, GroupRuns] = {}  # by id of the param group
        self._names: dict[int, str] = {}  # by id of the parameter, for errors
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group, its hyper-parameters checked (a ValueError names a bad one)."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        where = f"param_groups[{index}]"
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.numel() == 1):
            check_nonnegative(lr, f"learning rate {where}['lr']")
        elif group["foreach"]:
            raise ValueError(
                f"AdamW: {where} has a tensor lr and foreach=True; torch's foreach kernels "
                f"take a tensor lr only when capturable: leave foreach unset (None) or use a "
                f"float lr"
            )
        check_nonnegative(group["eps"], f"epsilon value {where}['eps']")
        check_nonnegative(group["weight_decay"], f"weight_decay value {where}['weight_decay']")
        group["betas"] = check_betas(group["betas"], f"{where}['betas']")
        names = group.get("param_names") or [
            f"{where}['params'][{i}]" for i in range(len(group["params"]))
        ]
        for param, name in zip(group["params"], names, strict=True):
            self._names[id(param)] = name

    def _name(self, param: torch.Tensor) -> str:
        return self._names.get(id(param), "a parameter")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict (torch's AdamW format), checking each state tensor's shape.

        Raises:
            ValueError: A state tensor's local shape differs from its parameter's piece.
        """
        super().load_state_dict(state_dict)
        self._state_changed()
        for group in self.param_groups:
            self._group_runs(group)
        self.state.changed = False

    def _state_changed(self) -> None:
        """Entries were edited: the runs re-read them into new flat state at their next use."""
        self._runs.clear()

    def _group_runs(self, group: dict[str, Any]) -> GroupRuns:
        runs = self._runs.get(id(group))
        if runs is None or not runs.is_current(group["params"]):
            runs = self._runs[id(group)] = GroupRuns(group["params"], self._name)
            keys = _state_keys(group)
            for run in runs.runs:
                self._adopt(run, keys)
        return runs

    def _adopt(self, run: Run, keys: tuple[str, ...]) -> None:
        """Moves the state the run's parameters already have into the run's flat state.

        That state was loaded, edited by a user, or made before their storage moved; each
        parameter's state then holds views of the flat state instead. A parameter without
        state starts afresh at its next step, as in torch's AdamW.

        Raises:
            ValueError: A parameter's state lacks one of `keys` (torch's AdamW would fail at
                its step with a KeyError).
        """
        held = [(i, self.state[p]) for i, p in enumerate(run.params) if self.state.get(p)]
        if not held:
            return
        for i, st in held:
            missing = [k for k in ("step", *keys) if k not in st]
            if missing:
                raise ValueError(
                    f"AdamW: the state of {self._name(run.params[i])} has no {missing[0]!r} "
                    f"(it has {sorted(st)}); give it {sorted(('step', *keys))}, or clear it "
                    f"to start afresh"
                )
        keys = tuple(sorted({*keys, *(k for _, st in held for k in st if k in _KEYS)}))
        run.state = {}
        for key in keys:
            flat = run.state_tensor(key)
            for i, st in held:
                value = st.get(key)
                if value is None:
                    continue
                piece = local_pieces([value])[0]
                if piece.shape != run.pieces[i].shape:
                    raise ValueError(
                        f"load_state_dict: state {key!r} of {self._name(run.params[i])} has "
                        f"local shape {tuple(piece.shape)} (global {tuple(value.shape)}), but "
                        f"the parameter's local piece is {tuple(run.pieces[i].shape)} (global "
                        f"{tuple(run.params[i].shape)})"
                    )
                run.part(flat, i, i + 1).copy_(piece)
        for i, st in held:
            run.load_counts(i, st.get("step"), self._name(run.params[i]))
            st["step"] = run.steps[i]
            for key in keys:
                if key in st:
                    st[key] = run.exposed(i, run.state[key])

    def _step(self) -> None:
        """One step on the current gradients (`step` runs the closure first, then this)."""
        for group in self.param_groups:
            segments = self._group_runs(group).segments()
            if segments:
                self._step_group(group, segments)

    def _step_group(self, group: dict[str, Any], segments: list[Segment]) -> None:
        amsgrad, fused = group["amsgrad"], bool(group["fused"])
        keys = _state_keys(group)
        for segment in segments:
            run = segment.run
            if run.counts[segment.lo] == 0:
                self._init_state(run, segment.lo, segment.hi, keys)
        operands = [
            [s.param, s.grad, *(s.run.part(s.run.state_tensor(k), s.lo, s.hi) for k in keys)]
            for s in segments
        ]
        counts = [s.run.counts[s.lo] for s in segments]
        if not fused:
            operands, counts = _cpu_chunks(operands, counts)
        # torch's kernels count each tensor's step in a tensor they increment: one per
        # tensor, on the device for the fused kernel (as torch.optim.AdamW keeps it).
        steps = [
            torch.tensor(float(c), device=ops[0].device if fused else None)
            for c, ops in zip(counts, operands, strict=True)
        ]
        columns = list(zip(*operands, strict=True))
        beta1, beta2 = group["betas"]
        adamw(
            list(columns[0]),
            list(columns[1]),
            list(columns[2]),
            list(columns[3]),
            list(columns[4]) if amsgrad else [],
            steps,
            foreach=None if fused else _foreach(group),
            fused=fused or None,
            has_complex=any(s.param.is_complex() for s in segments),
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )
        for segment in segments:
            segment.run.advance(segment.lo, segment.hi)

    def _init_state(self, run: Run, lo: int, hi: int, keys: tuple[str, ...]) -> None:
        """The first step of parameters lo .. hi-1: their state, views of the run's."""
        for i in range(lo, hi):
            state = self.state[run.params[i]]
            if state:
                continue
            state["step"] = run.steps[i]
            for key in keys:
                state[key] = run.exposed(i, run.state_tensor(key))


def _state_keys(group: dict[str, Any]) -> tuple[str, ...]:
    """The state tensors a parameter of `group` has besides `step` (torch's AdamW's)."""
    return _KEYS if group["amsgrad"] else _MOMENTS


def _foreach(group: dict[str, Any]) -> bool:
    """Whether the foreach kernels run: as torch's AdamW decides when unset (`foreach=None`).

    torch turns them off for a tensor learning rate, which they take only when capturable.
    """
    if group["foreach"] is None:
        return not isinstance(group["lr"], torch.Tensor)
    return bool(group["foreach"])


def _cpu_chunks(
    operands: list[list[torch.Tensor]], counts: list[int]
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Long CPU tensors in chunks of `_CPU_FOREACH_CHUNK` elements (the same arithmetic).

    Only contiguous ones: their chunks are views, so the kernels update them in place.
    """
    if not any(map(_chunkable, operands)):
        return operands, counts
    out_operands, out_counts = [], []
    for ops, count in zip(operands, counts, strict=True):
        if not _chunkable(ops):
            out_operands.append(ops)
            out_counts.append(count)
            continue
        chunks = [torch.split(t.view(-1), _CPU_FOREACH_CHUNK) for t in ops]
        out_operands += [list(c) for c in zip(*chunks, strict=True)]
        out_counts += [count] * len(chunks[0])
    return out_operands, out_counts


def _chunkable(operands: list[torch.Tensor]) -> bool:
    first = operands[0]
    return (
        first.numel() > _CPU_FOREACH_CHUNK
        and first.device.type == "cpu"
        and all(t.is_contiguous() for t in operands)
    )
