"""AdamW8bit's update of one rank's blocks: one function, run fused or op by op.

`blockwise_adamw` reads the parameter, its gradient and both moments' codes and block scales,
and writes them back: dequantize, the AdamW update in float32, the new block absmax, and the
nearest codes. Three implementations give the same bits:
- native (CPU): `_adamw8bit_cpu.cpp`, one pass per block with the block's new moments in L1;
- compiled: `update_blocks` under torch.compile (Triton on CUDA; on CPU inductor's C++, three
  loop nests with the new moments in full-size float32 buffers between them);
- eager: the same arithmetic op by op.
Every step is one IEEE operation written out (no lerp, addcmul or addcdiv, whose CPU kernels
may contract into FMAs depending on the CPU), and the square root is correctly rounded on
every path (ATen's CPU sqrt is not, so eagerly it runs in float64 and rounds), which makes
the paths agree bit for bit on CPU and each element's result independent of where it sits in
the tensor, so of how the tensor is sharded.

`BlockwiseKernel` decides once per device type which path runs: the fastest that builds
(native on CPU, compiled elsewhere) unless the caller said eager; when none builds (no C++
compiler, no Triton, a Python that Dynamo does not support) it says why and runs eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ragged_optimizers._compat import compile_options, mark_dims_dynamic
from ragged_optimizers._kernel_args import Piece8bit, Tables
from ragged_optimizers._native import CpuKernel, NativeKernelError, load_cpu_kernel
from ragged_optimizers._quantize import (
    blocked,
    device_tables,
    dynamic_map,
    nearest_codes,
    unblocked,
)

logger = logging.getLogger(__name__)

Fused = bool | Literal["native", "compiled"] | None

# The float32 scalars of one step, in this order (computed in float64 by `step_scalars`).
_DECAY, _WEIGHT1, _BETA2, _WEIGHT2, _BIAS2_SQRT, _EPS, _NEG_STEP_SIZE = range(7)


def step_scalars(
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    device: torch.device,
) -> torch.Tensor:
    """The step's scalars as one float32 tensor, so that a new lr does not recompile.

    Example:
        >>> step_scalars(step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
        ...              device=torch.device("cpu"))[-1]
        tensor(-1.)
    """
    beta1, beta2 = betas
    values = [
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        (1 - beta2**step) ** 0.5,
        eps,
        -lr / (1 - beta1**step),
    ]
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def code_tables(
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(signed map, unsigned map, signed code lookup, unsigned code lookup) on `device`.

    Looked up outside the compiled function: traced inside, the tables would be rebuilt.
    """
    (signed_map, signed_lookup), (unsigned_map, unsigned_lookup) = (
        device_tables(device, signed) for signed in (True, False)
    )
    return signed_map, unsigned_map, signed_lookup, unsigned_lookup


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.sqrt(x)  # inductor's sqrt is the IEEE one on CPU and CUDA
    if x.device.type == "cpu":
        # float64 sqrt rounded to float32 is the correctly rounded float32 sqrt.
        return torch.sqrt(x.double()).float()
    return torch.sqrt(x)


def _requantize(x: torch.Tensor, lookup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of blocked (row blocks, rows, col blocks, cols) float32 values."""
    scales = x.abs().amax(dim=(1, 3))
    divisor = torch.where(scales > 0, scales, 1.0)  # an all-zero block: codes of 0.0
    return nearest_codes(x / divisor[:, None, :, None], lookup), scales


def update_blocks(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    scalars: torch.Tensor,
    tables: Tables,
) -> None:
    """The update on whole blocks, in place: the function torch.compile compiles.

    param, grad and both codes are (row blocks, block rows, col blocks, block cols), the
    scales (row blocks, col blocks): plain views of a piece whose sizes are multiples of the
    block, so the compiled loops index them linearly (no division per element).
    """
    signed_map, unsigned_map, signed_lookup, unsigned_lookup = tables
    # Eagerly, the common cases skip whole passes (same bits: the skipped ops are identities).
    eager = not torch.compiler.is_compiling()
    m = signed_map[exp_avg.int()] * exp_avg_scale[:, None, :, None]
    v = unsigned_map[exp_avg_sq.int()] * exp_avg_sq_scale[:, None, :, None]
    start = param.float()
    g = grad.float()
    finite = None if eager and bool(torch.isfinite(g).all()) else torch.isfinite(g)
    if finite is not None:
        g = torch.where(finite, g, 0.0)
    # torch's lerp: start + w * (end - start) below w = 0.5, end - (end - start) * (1 - w) above.
    w1 = scalars[_WEIGHT1]
    if not eager:
        m = torch.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1 - w1))
    elif float(w1) < 0.5:
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1 - w1)
    v = v * scalars[_BETA2] + scalars[_WEIGHT2] * g * g
    denom = _sqrt(v) / scalars[_BIAS2_SQRT] + scalars[_EPS]
    p = start * scalars[_DECAY] + scalars[_NEG_STEP_SIZE] * m / denom
    if finite is not None:
        p, m, v = (
            torch.where(finite, p, start),
            torch.where(finite, m, 0.0),
            torch.where(finite, v, 0.0),
        )
    m_codes, m_scales = _requantize(m, signed_lookup)
    v_codes, v_scales = _requantize(v, unsigned_lookup)
    param.copy_(p)
    exp_avg.copy_(m_codes)
    exp_avg_scale.copy_(m_scales)
    exp_avg_sq.copy_(v_codes)
    exp_avg_sq_scale.copy_(v_scales)


@functools.cache
def _zero_code(signed: bool) -> int:
    return int(torch.searchsorted(dynamic_map(signed), 0.0))


def blockwise_adamw(
    piece: Piece8bit,
    scalars: torch.Tensor,
    tables: Tables,
    block: tuple[int, int],
    update: Callable[..., None] = update_blocks,
) -> None:
    """One AdamW8bit step on a 2-D piece of whole row blocks, everything updated in place.

    An element whose gradient is NaN or +-Inf keeps its parameter value and gets zero moments.
    A piece whose sizes are not multiples of the block (the bottom or right edge of a
    tensor) is run on zero-padded copies (zeros decode to zero moments and leave every
    block's absmax as it is), then copied back.

    Args:
        piece: The parameter (updated in float32 and stored back), its gradient and both
            moments' codes and scales.
        scalars: `step_scalars(...)` on param's device.
        tables: `code_tables(param.device)`: both maps and both code lookups.
        block: (block_rows, block_cols).
        update: `update_blocks`, or its compiled form.

    Example:
        >>> p, g = torch.ones(2, 3), torch.full((2, 3), 0.5)
        >>> codes, scales = torch.full((2, 3), 127, dtype=torch.uint8), torch.zeros(1, 1)
        >>> s = step_scalars(step=1, lr=0.1, betas=(0.9, 0.999), eps=0.0, weight_decay=0.0,
        ...                  device=p.device)
        >>> piece = Piece8bit(p, g, codes, scales, codes.clone(), scales.clone())
        >>> blockwise_adamw(piece, s, code_tables(p.device), (32, 32))
        >>> p  # the first step moves every element by lr
        tensor([[0.9000, 0.9000, 0.9000],
                [0.9000, 0.9000, 0.9000]])
    """
    param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale = piece
    rows, cols = param.shape
    block_rows, block_cols = block
    grid = exp_avg_scale.shape
    if rows % block_rows == 0 and cols % block_cols == 0:
        shape = (grid[0], block_rows, grid[1], block_cols)
        tensors = [t.view(shape) for t in (param, grad, exp_avg, exp_avg_sq)]
    else:
        fills = (0, 0, _zero_code(True), _zero_code(False))
        tensors = [
            blocked(t, block, fill)
            for t, fill in zip((param, grad, exp_avg, exp_avg_sq), fills, strict=True)
        ]
    p4, g4, m4, v4 = tensors
    update(*Piece8bit(p4, g4, m4, exp_avg_scale, v4, exp_avg_sq_scale), scalars, tables)
    if p4.data_ptr() != param.data_ptr():
        for target, blocks in ((param, p4), (exp_avg, m4), (exp_avg_sq, v4)):
            target.copy_(unblocked(blocks, rows, cols))


_Args = tuple[Piece8bit, torch.Tensor, Tables]  # blockwise_adamw's before `block`


@dataclass(frozen=True)
class KernelPath:
    """Which implementation of the blockwise update ran on a device type.

    Attributes:
        device_type: "cpu", "cuda", ...
        kind: "native" (the C++ kernel, CPU), "compiled" (torch.compile's pass) or "eager".
        reason: Why not native (CPU) or not compiled (other devices); empty when it ran the
            fastest path there is.
        compile_seconds: Wall time of building the kernel (the first compiled call, or the
            C++ build; near 0 when the C++ kernel came from its cache).
    """

    device_type: str
    kind: Literal["native", "compiled", "eager"]
    reason: str = ""
    compile_seconds: float = 0.0

    def __str__(self) -> str:
        why = f"; {self.reason}" if self.reason else ""
        if self.kind == "native":
            return f"native ({self.device_type}, built in {self.compile_seconds:.1f} s)"
        if self.kind == "compiled":
            return f"compiled ({self.device_type}, first call {self.compile_seconds:.1f} s{why})"
        return f"eager ({self.device_type}: {self.reason})"


class BlockwiseKernel:
    """Runs `blockwise_adamw` by the fastest implementation that works; records which.

    On CPU that is the C++ kernel (`_native.py`), then torch.compile's pass; on other devices
    torch.compile's pass (Triton on CUDA). All give the eager ops' bits.

    Args:
        fused: None: the fastest that builds, falling back to eager with a warning naming
            the reason; True: the fastest that builds, or an error; "native" or "compiled":
            that one, or an error; False: eager.

    Example:
        >>> kernel = BlockwiseKernel(fused=False)
        >>> p, g = torch.ones(2, 3), torch.zeros(2, 3)
        >>> codes, scales = torch.full((2, 3), 127, dtype=torch.uint8), torch.zeros(1, 1)
        >>> s = step_scalars(step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
        ...                  device=p.device)
        >>> kernel(Piece8bit(p, g, codes, scales, codes.clone(), scales.clone()), s, (32, 32))
        >>> str(kernel.paths["cpu"])
        'eager (cpu: fused=False)'
    """

    def __init__(self, fused: Fused = None) -> None:
        named = isinstance(fused, str) and fused in ("native", "compiled")
        if not (fused is None or isinstance(fused, bool) or named):
            raise ValueError(
                f"fused must be None, True, False, 'native' or 'compiled', got {fused!r}"
            )
        self.fused = fused
        self.paths: dict[str, KernelPath] = {}
        self._compiled_update: Callable[..., None] | None = None
        self._cpu_kernel: CpuKernel | None = None

    def __call__(self, piece: Piece8bit, scalars: torch.Tensor, block: tuple[int, int]) -> None:
        device = piece.param.device
        args = (piece, scalars, code_tables(device))
        path = self.paths.get(device.type)
        if path is None:
            path = self.paths[device.type] = self._first_call(device.type, args, block)
        elif path.kind == "native":
            assert self._cpu_kernel is not None
            self._cpu_kernel(*args, block)
        else:
            update = self._compiled if path.kind == "compiled" else update_blocks
            blockwise_adamw(*args, block, update)

    def _first_call(self, device_type: str, args: _Args, block: tuple[int, int]) -> KernelPath:
        """Runs the first update on a device type by the best path that works; says which."""
        if self.fused is False:
            blockwise_adamw(*args, block)
            return KernelPath(device_type, "eager", "fused=False")
        if self.fused == "native" and device_type != "cpu":
            raise RuntimeError(
                f"AdamW8bit(fused='native') is the CPU kernel; for {device_type} parameters "
                f"use fused=None, True or 'compiled'"
            )
        not_native = ""
        if device_type == "cpu" and self.fused != "compiled":
            try:
                self._cpu_kernel = load_cpu_kernel()
            except NativeKernelError as error:
                if self.fused == "native":
                    raise RuntimeError(f"AdamW8bit(fused='native'): {error}") from error
                not_native = f"C++ kernel unavailable: {error}"
                logger.warning("AdamW8bit: %s; trying torch.compile", not_native)
            else:
                self._cpu_kernel(*args, block)
                return KernelPath(device_type, "native", "", self._cpu_kernel.build_seconds)
        path = self._first_compiled_call(device_type, args, block)
        if not_native:
            reason = f"{not_native}; {path.reason}" if path.reason else not_native
            path = dataclasses.replace(path, reason=reason)
        return path

    def _compiled(self, *args: Any) -> None:
        if self._compiled_update is None:
            self._compiled_update = torch.compile(
                update_blocks, fullgraph=True, options=compile_options()
            )
        # Symbolic row and column block counts: one compilation serves every shape, while
        # the block sizes stay constants of the code.
        mark_dims_dynamic(args[:6], (0, 2))
        self._compiled_update(*args)

    def _first_compiled_call(
        self, device_type: str, args: _Args, block: tuple[int, int]
    ) -> KernelPath:
        start = time.perf_counter()
        try:
            # A failed compilation raises before the graph runs: nothing was written yet.
            blockwise_adamw(*args, block, self._compiled)
        except torch.OutOfMemoryError:
            raise  # not a compiler failure, and the graph may have written part of its output
        except Exception as error:  # any compiler failure means: run eagerly
            if self.fused is not None:
                raise RuntimeError(
                    f"AdamW8bit(fused={self.fused!r}): torch.compile could not build the blockwise "
                    f"update on {device_type}: {type(error).__name__}: {error}"
                ) from error
            reason = f"torch.compile failed: {type(error).__name__}: {str(error)[:200]}"
            logger.warning("AdamW8bit runs its update eagerly on %s (%s)", device_type, reason)
            blockwise_adamw(*args, block)
            return KernelPath(device_type, "eager", reason)
        return KernelPath(device_type, "compiled", compile_seconds=time.perf_counter() - start)
