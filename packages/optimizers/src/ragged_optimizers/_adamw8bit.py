"""AdamW with both moments in 8 bits, one float32 scale per 2-D block.

Per step and parameter: dequantize the moments, update them and the parameter in float32 (the
parameter update uses the new unquantized moments), then requantize with the new block absmax,
in one pass over the rank's blocks (`_blockwise.py`, compiled by default). The state of a 2-D
parameter with at least `min_8bit_numel` elements (decided on the global shape, so every mesh
makes the same choice) is 8-bit; any other keeps float32 moments. A sharded parameter's pieces
must hold whole blocks of rows, which makes each rank's codes and scales the exact slice of the
one-process state: the step needs no communication and gives the same bits on any number of
ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ragged_optimizers._adamw import adamw_step, check_betas, check_nonnegative
from ragged_optimizers._blockwise import BlockwiseKernel, Fused, KernelPath, step_scalars
from ragged_optimizers._kernel_args import Piece8bit
from ragged_optimizers._layout import ParamLayout, layout_of, local_flat
from ragged_optimizers._runs import GroupRuns, Run, Segment
from ragged_optimizers._step import StepOptimizer
from ragged_placement import RaggedShard

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _check_block(block_size: object) -> tuple[int, int]:
    if isinstance(block_size, tuple | list) and len(block_size) == 2:
        rows, cols = block_size
        if all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in (rows, cols)):
            return int(rows), int(cols)
    raise ValueError(f"block_size must be a pair of ints >= 1, got {block_size!r}")


class AdamW8bit(StepOptimizer):
    """AdamW whose moments are stored in 8 bits per element plus a float32 scale per block.

    Works on plain tensors, RaggedShard DTensors (cut at multiples of `block_size[0]` rows:
    `block_rows=32` in DBuffer / fully_shard), also beside tensor-parallel Shard(d) whose
    pieces are whole blocks, and Shard(0) DTensors whose chunks are whole blocks. State of
    about 2.008 bytes per parameter for 32 x 32 blocks (fp32 AdamW: 8).

    Non-finite gradients: an element whose gradient is NaN or +-Inf is skipped (the
    parameter keeps its value, weight decay included) and both its moments are reset to 0.

    Args:
        params: Parameters, named parameters or param groups.
        lr: Learning rate.
        betas: (beta1, beta2).
        eps: Added to the bias-corrected square root of the second moment.
        weight_decay: Decoupled weight decay (p *= 1 - lr * weight_decay).
        block_size: (rows, cols) of a quantization block.
        min_8bit_numel: 2-D parameters with fewer elements (global count) keep fp32 state.
        fused: How the 8-bit update runs. None (default): one fused pass per parameter,
            on CPU a C++ kernel built on first use ("native"), elsewhere torch.compile's
            ("compiled": Triton on CUDA), falling back to eager ops with a warning if
            neither builds; True: the same, but an error instead of eager; "native" or
            "compiled": that one or an error; False: eager ops. All give the same bits;
            `kernel_paths` says which ran.

    Example:
        >>> layer = torch.nn.Linear(128, 64)
        >>> opt = AdamW8bit(layer.parameters())
        >>> layer(torch.randn(2, 128)).sum().backward()
        >>> opt.step()
        >>> opt.state[layer.weight]["exp_avg"].dtype, opt.state[layer.bias]["exp_avg"].dtype
        (torch.uint8, torch.float32)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: tuple[int, int] = (32, 32),
        min_8bit_numel: int = 4096,
        *,
        fused: Fused = None,
    ) -> None:
        self._kernel = BlockwiseKernel(fused)
        value: object = min_8bit_numel  # callers may pass anything; check before use
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"min_8bit_numel must be an int >= 0 (0: every 2-D parameter 8-bit), got "
                f"{min_8bit_numel!r}"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "block_size": block_size,
            "min_8bit_numel": min_8bit_numel,
        }
        self._layouts: dict[int, ParamLayout] = {}
        self._param_names: dict[int, str] = {}
        self._runs: dict[int, GroupRuns] = {}  # by id of the param group
        super().__init__(params, defaults)

    @property
    def kernel_paths(self) -> dict[str, KernelPath]:
        """Per device type, which update ran (compiled or eager, and why), after a step.

        Example:
            >>> layer = torch.nn.Linear(128, 64)
            >>> opt = AdamW8bit(layer.parameters(), fused=False)
            >>> layer(torch.randn(2, 128)).sum().backward()
            >>> opt.step()
            >>> str(opt.kernel_paths["cpu"])
            'eager (cpu: fused=False)'
        """
        return dict(self._kernel.paths)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group (checked: hyper-parameters, and block-aligned shards)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_nonnegative(group["lr"], "learning rate")
        check_nonnegative(group["eps"], "epsilon value")
        check_nonnegative(group["weight_decay"], "weight_decay value")
        group["betas"] = check_betas(group["betas"])
        group["block_size"] = _check_block(group["block_size"])
        names = group.get("param_names") or [
            f"params[{len(self._param_names) + i}]" for i in range(len(group["params"]))
        ]
        for param, name in zip(group["params"], names, strict=True):
            self._param_names[id(param)] = name
            layout = self._layouts[id(param)] = layout_of(param, name)
            if self._is_8bit(layout, group):
                _block_rows(layout, group["block_size"], name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict, keeping each state tensor's own dtype.

        torch.optim casts floating state to its parameter's dtype; here that would turn codes
        into floats and round fp32 moments and scales to a bf16 parameter's precision.
        """
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                loaded = self.state[param].get(key)
                cast = isinstance(value, torch.Tensor) and loaded is not None
                if cast and loaded.dtype != value.dtype:
                    self.state[param][key] = value.to(device=loaded.device)
        self._state_changed()
        for group in self.param_groups:
            self._group_runs(group)
        self.state.changed = False

    def _state_changed(self) -> None:
        """Entries were edited: the runs re-read them into new flat state at their next use."""
        self._runs.clear()

    @staticmethod
    def _is_8bit(layout: ParamLayout, group: dict[str, Any]) -> bool:
        return len(layout.full_shape) == 2 and layout.full_numel >= group["min_8bit_numel"]

    def _name(self, param: torch.Tensor) -> str:
        return self._param_names.get(id(param), "a parameter")

    def _group_runs(self, group: dict[str, Any]) -> GroupRuns:
        runs = self._runs.get(id(group))
        if runs is None or not runs.is_current(group["params"]):
            cut = functools.partial(self._cut, group)
            runs = self._runs[id(group)] = GroupRuns(group["params"], self._name, cut)
            for run in runs.runs:
                self._adopt(run, group)
        return runs

    def _cut(self, group: dict[str, Any], before: torch.Tensor, after: torch.Tensor) -> bool:
        """Whether a run must end between two adjacent parameters: its blocks must tile it.

        8-bit pieces join when they have the same number of columns and the first ends on a
        block boundary (its piece holds whole blocks of rows); fp32-state pieces join any.
        """
        first, second = self._layouts[id(before)], self._layouts[id(after)]
        eight_bit = self._is_8bit(first, group)
        if eight_bit != self._is_8bit(second, group):
            return True
        if not eight_bit:
            return False
        cols = first.shape[-1]
        lo, hi = first.local_range
        return cols != second.shape[-1] or (hi - lo) % (group["block_size"][0] * cols) != 0

    def _step(self) -> None:
        """One step on the current gradients (`step` runs the closure first, then this)."""
        scalars: dict[Any, torch.Tensor] = {}  # one tensor per distinct step and settings
        for group in self.param_groups:
            for segment in self._group_runs(group).segments():
                self._update(segment, group, scalars)
                segment.run.advance(segment.lo, segment.hi)

    def _update(
        self, segment: Segment, group: dict[str, Any], scalars: dict[Any, torch.Tensor]
    ) -> None:
        """One step of parameters lo .. hi-1 of a run, as one tensor."""
        run, lo, hi = segment.run, segment.lo, segment.hi
        layout = self._layouts[id(run.params[lo])]
        eight_bit = self._is_8bit(layout, group)
        if run.counts[lo] == 0:
            self._init_state(run, lo, hi, group, eight_bit)
        step = run.counts[lo] + 1
        local, grad = segment.param.view(-1), segment.grad.view(-1)
        if not eight_bit:
            moments = {key: run.part(run.state[key], lo, hi) for key in _MOMENTS}
            _fp32_state_update(local, grad, moments, step, group)
            return
        if local.numel() == 0:
            return
        block = group["block_size"]
        cols = layout.shape[-1]
        first, end = _scale_rows(run, lo, hi, cols * block[0])
        key = (step, group["lr"], group["betas"], group["eps"], group["weight_decay"], local.device)
        if key not in scalars:
            scalars[key] = step_scalars(
                step=step,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                device=local.device,
            )
        piece = Piece8bit(
            local.view(-1, cols),
            grad.view(-1, cols),
            run.part(run.state["exp_avg"], lo, hi).view(-1, cols),
            run.state["exp_avg_scale"][first:end],
            run.part(run.state["exp_avg_sq"], lo, hi).view(-1, cols),
            run.state["exp_avg_sq_scale"][first:end],
        )
        self._kernel(piece, scalars[key], block)

    def _flat_state(self, run: Run, group: dict[str, Any], eight_bit: bool) -> None:
        """The run's flat state, zeros: codes and a scale grid (8-bit), or fp32 moments."""
        if run.state:
            return
        if not eight_bit:
            for key in _MOMENTS:
                run.state_tensor(key, torch.float32)
            return
        block = group["block_size"]
        layout = self._layouts[id(run.params[0])]
        cols = layout.shape[-1]
        grid_cols = -(-cols // block[1])
        _, num_rows = _scale_rows(run, 0, len(run.params), cols * block[0])
        for key in _MOMENTS:
            run.state_tensor(key, torch.uint8)
            run.state[f"{key}_scale"] = torch.zeros(num_rows, grid_cols, device=run.flat.device)

    def _exposed(self, run: Run, index: int, group: dict[str, Any], key: str) -> torch.Tensor:
        """Parameter `index`'s view of the run's flat state `key`, laid out like it."""
        param = run.params[index]
        layout = self._layouts[id(param)]
        if not key.endswith("_scale"):
            return layout.wrap(run.part(run.state[key], index, index + 1), param)
        block = group["block_size"]
        cols = layout.shape[-1]
        first, end = _scale_rows(run, index, index + 1, cols * block[0])
        grid_cols = -(-cols // block[1])
        rows = _block_rows(layout, block, self._name(param))
        return _wrap_grid(run.state[key][first:end], layout, param, rows, grid_cols)

    def _init_state(
        self, run: Run, lo: int, hi: int, group: dict[str, Any], eight_bit: bool
    ) -> None:
        """The first step of parameters lo .. hi-1: their state, views of the run's."""
        self._flat_state(run, group, eight_bit)
        for i in range(lo, hi):
            state = self.state[run.params[i]]
            if state:
                continue
            state["step"] = run.steps[i]
            for key in run.state:
                state[key] = self._exposed(run, i, group, key)

    def _adopt(self, run: Run, group: dict[str, Any]) -> None:
        """Moves the state the run's parameters already have into the run's flat state.

        That state was loaded, or made before their storage moved; each parameter's state
        then holds views of the flat state instead.
        """
        held = [(i, self.state[p]) for i, p in enumerate(run.params) if self.state.get(p)]
        if not held:
            return
        run.state = {}
        self._flat_state(run, group, self._is_8bit(self._layouts[id(run.params[0])], group))
        for i, state in held:
            name = self._name(run.params[i])
            for key in list(run.state):
                value = state.get(key)
                if value is None:
                    raise ValueError(f"load_state_dict: the state of {name} has no {key!r}")
                target = self._exposed(run, i, group, key)
                piece, into = local_flat(value), local_flat(target)
                if piece.shape != into.shape or piece.dtype != into.dtype:
                    raise ValueError(
                        f"load_state_dict: state {key!r} of {name} has local shape "
                        f"{tuple(piece.shape)} and dtype {piece.dtype}; this layout needs "
                        f"{tuple(into.shape)} and {into.dtype}"
                    )
                into.copy_(piece)
                state[key] = target
            run.load_counts(i, state.get("step"), name)
            state["step"] = run.steps[i]


def _scale_rows(run: Run, lo: int, hi: int, block_numel: int) -> tuple[int, int]:
    """[first, end) rows of the run's scale grid that parameters lo .. hi-1 cover.

    Every piece but the run's last holds whole blocks of rows (`_cut`), so a piece's first
    row of blocks is its start over the block's elements, and its end rounds up.
    """
    return run.positions[lo] // block_numel, -(-run.positions[hi] // block_numel)


def _fp32_state_update(
    local: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    step: int,
    group: dict[str, Any],
) -> None:
    """AdamW on float32 moments (small and non-2-D parameters), non-finite elements skipped."""
    work = local if local.dtype == torch.float32 else local.float()
    # One reduction decides the common case; a NaN or Inf anywhere makes the sum
    # non-finite (as can a finite overflow, which only costs the masked path below).
    finite = None if bool(torch.isfinite(grad.sum())) else torch.isfinite(grad)
    before = None if finite is None else work.clone()
    grad32 = grad.float() if finite is None else torch.where(finite, grad.float(), 0.0)
    exp_avg, exp_avg_sq = local_flat(state["exp_avg"]), local_flat(state["exp_avg_sq"])
    adamw_step(
        work,
        grad32,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=group["lr"],
        betas=group["betas"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
    )
    if finite is not None and before is not None:
        work.copy_(torch.where(finite, work, before))
        exp_avg.masked_fill_(~finite, 0.0)
        exp_avg_sq.masked_fill_(~finite, 0.0)
    if work is not local:
        local.copy_(work)


def _block_rows(layout: ParamLayout, block: tuple[int, int], name: str) -> list[tuple[int, int]]:
    """Every rank's [first, end) block row; a ValueError when a piece cuts a block."""
    cols = layout.shape[1]
    if layout.global_shape is not None:  # tensor parallel: blocks must tile each tp piece
        for dim in (0, 1):
            if layout.shape[dim] != layout.global_shape[dim] and layout.shape[dim] % block[dim]:
                raise ValueError(
                    f"AdamW8bit: {name} of shape {layout.global_shape} is split by tensor "
                    f"parallelism into pieces of {layout.shape}, whose dim {dim} "
                    f"({layout.shape[dim]}) is not a multiple of the block's {block[dim]}: a "
                    f"quantization block would straddle two ranks; choose sizes that divide, "
                    f"or give it fp32 state (min_8bit_numel > {layout.full_numel})"
                )
    out = []
    for rank in range(layout.num_ranks):
        rows = layout.piece_rows(rank, block[0] * cols)
        if rows is None:
            lo, hi = layout.ranges[rank]
            raise ValueError(
                f"AdamW8bit: {name} of shape {layout.shape} is sharded so that rank {rank} "
                f"holds elements [{lo}, {hi}), which cuts a {block[0]}-row quantization block; "
                f"shard it in whole blocks (block_rows={block[0]} in DBuffer / fully_shard) or "
                f"give it fp32 state (min_8bit_numel > {layout.numel})"
            )
        out.append(rows)
    return out


def _wrap_grid(
    scales: torch.Tensor,
    layout: ParamLayout,
    like: torch.Tensor,
    rows: list[tuple[int, int]],
    grid_cols: int,
) -> torch.Tensor:
    """The local scales as a DTensor of the whole grid, split like the parameter's blocks.

    The shard axis cuts the grid's rows (of this rank's tensor-parallel piece) raggedly;
    tensor-parallel Shard(d) axes split the grid as they split the parameter (blocks tile
    each piece, checked in `_block_rows`).
    """
    if not isinstance(like, DTensor):
        return scales
    placements: list[Placement] = [
        p if isinstance(p, Shard) and layout.global_shape is not None else Replicate()
        for p in like.placements
    ]
    if layout.axis is not None:
        placements[layout.axis] = RaggedShard((0,), [hi - lo for lo, hi in rows])
    local = scales.view(-1) if layout.axis is not None else scales
    grid = [rows[-1][1], grid_cols]  # of the block; the whole grid over the other axes:
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            grid[placement.dim % 2] *= like.device_mesh.size(axis)
    return DTensor.from_local(
        local,
        like.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(grid),
        stride=(grid[1], 1),
    )


def _local2d(tensor: torch.Tensor, cols: int) -> torch.Tensor:
    return local_flat(tensor).view(-1, cols)
