"""Muon's momentum and weight decay, one tensor per run of adjacent parameter pieces.

On `fully_shard` a rank's pieces of a group's parameters, and of their gradients, are adjacent
views of one flat shard (`_runs.py`). Muon's elementwise passes (the momentum's EMA, the
Nesterov input, the decoupled weight decay) then run over each run as one tensor: a few
kernels per run, not per matrix, with the same arithmetic on every element as per matrix. The
momentum is one flat tensor per run; each parameter's `state["momentum_buffer"]` is a view of
its part, laid out like the parameter, so state dicts, DCP and edits see torch's format. An
edited or loaded entry is read back into the run's flat tensor at the next step (the
optimizer's state tracks edits). What is left per matrix is the orthogonalization and its
exchange, which are per matrix by nature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ragged_optimizers._compat import foreach_lerp, foreach_lerp_, foreach_mul_
from ragged_optimizers._muon_exchange import COMM_DTYPE
from ragged_optimizers._runs import GroupRuns
from ragged_placement import local_pieces

MOMENTUM = "momentum_buffer"


def momentum_runs(
    params: Sequence[torch.Tensor], state: Any, name_of: Callable[[torch.Tensor], str]
) -> GroupRuns:
    """A Muon group's runs, holding the momentum its parameters' state entries already have.

    Raises:
        ValueError: An entry's momentum does not have its parameter's local shape.
    """
    runs = GroupRuns(params, name_of)
    for run in runs.runs:
        held = [(i, state[p]) for i, p in enumerate(run.params) if MOMENTUM in state.get(p, {})]
        if not held:
            continue
        flat = run.state_tensor(MOMENTUM)
        for i, entry in held:
            piece = local_pieces([entry[MOMENTUM]])[0]
            if piece.shape != run.pieces[i].shape:
                raise ValueError(
                    f"Muon: the momentum_buffer of {name_of(run.params[i])} has local shape "
                    f"{tuple(piece.shape)}, but the parameter's local piece is "
                    f"{tuple(run.pieces[i].shape)}"
                )
            run.part(flat, i, i + 1).copy_(piece)
            entry[MOMENTUM] = run.exposed(i, flat)
        run.set_counts([i for i, _ in held], 1)  # has momentum (Muon keeps no step count)
    return runs


def step_momenta(runs: GroupRuns, group: dict[str, Any], state: Any) -> dict[int, torch.Tensor]:
    """Updates the momentum and decays the weights of the group's parameters with a gradient.

    Returns:
        By parameter id, the flat local piece of what Newton-Schulz orthogonalizes (the
        momentum, or with Nesterov lerp(grad, momentum, momentum)) in bfloat16: Newton-Schulz
        casts its input to bfloat16 first, and the exchange moves it so; one cast per run.
    """
    segments = runs.segments()
    if not segments:
        return {}
    bufs = []
    for segment in segments:
        run, lo, hi = segment.run, segment.lo, segment.hi
        flat = run.state_tensor(MOMENTUM)
        if run.counts[lo] == 0:  # their first step: their entries view the run's zeros
            for i in range(lo, hi):
                state[run.params[i]][MOMENTUM] = run.exposed(i, flat)
            run.set_counts(range(lo, hi), 1)
        bufs.append(run.part(flat, lo, hi))
    grads = [segment.grad for segment in segments]
    momentum = group["momentum"]
    foreach_lerp_(bufs, grads, 1 - momentum)
    inputs = foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
    decay = 1 - group["lr"] * group["weight_decay"]
    if decay != 1:
        foreach_mul_([segment.param for segment in segments], decay)
    out: dict[int, torch.Tensor] = {}
    for segment, values in zip(segments, inputs, strict=True):
        run, flat_values = segment.run, values.to(COMM_DTYPE).reshape(-1)
        start = run.positions[segment.lo]
        for i in range(segment.lo, segment.hi):
            out[id(run.params[i])] = flat_values[
                run.positions[i] - start : run.positions[i + 1] - start
            ]
    return out
