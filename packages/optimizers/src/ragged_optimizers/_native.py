"""AdamW8bit's CPU update as a small C++ kernel, built on first use with the system compiler.

torch.compile's C++ for the blockwise update runs the block absmax as its own loop nest
between the update and the encode, keeping the new moments in full-size float32 buffers, and
reads the code tables one scalar at a time; `_adamw8bit_cpu.cpp` does each block in one pass
with its moments in L1 and lets the compiler turn table reads into vector gathers, about 2.5x
faster. It is plain C++ (no torch headers), so it builds in about a second; the shared
library is cached under `$RAGGED_OPTIMIZERS_CACHE` (default `~/.cache/ragged_optimizers`),
keyed by the source, the compiler, its flags and this CPU, and loaded with ctypes.

`load_cpu_kernel()` returns the kernel or raises `NativeKernelError` saying why not (no
compiler, the build failed, the library did not load); the caller then takes the
torch.compile path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ragged_optimizers._kernel_args import Piece8bit, Tables
from ragged_optimizers._quantize import _KEY_MASK

_SOURCE = Path(__file__).with_name("_adamw8bit_cpu.cpp")
# -ffp-contract=off: no FMA contraction (the eager path rounds every product); -march=native:
# gathers and wide vectors where this CPU has them (the cache key holds the CPU's flags).
_FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
)
_FLOAT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_NUM_SCALARS = 7  # _blockwise.step_scalars
_LOOKUP_SIZE = _KEY_MASK + 1  # entries of _quantize.code_lookup


class NativeKernelError(RuntimeError):
    """The C++ kernel cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class CpuKernel:
    """The loaded kernel, and how long building (or finding) it took.

    Attributes:
        function: `ragged_adamw8bit_update` from the shared library.
        library: The shared library's path.
        build_seconds: Wall time of the build (near 0 when it came from the cache).
    """

    function: Callable[..., None]
    library: Path
    build_seconds: float

    def __call__(
        self, piece: Piece8bit, scalars: torch.Tensor, tables: Tables, block: tuple[int, int]
    ) -> None:
        """One AdamW8bit step on a contiguous 2-D CPU piece, in place (as `blockwise_adamw`).

        A parameter of another float dtype than float32 or bfloat16 is updated through a
        float32 copy, which rounds exactly as the eager path's `param.copy_(p)` does.
        """
        param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale = piece
        work, work_grad = param, grad
        if param.dtype not in _FLOAT_DTYPES or grad.dtype != param.dtype:
            work, work_grad = param.float(), grad.float()
        work_grad = work_grad.contiguous()
        rows, cols = work.shape
        moments = (exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale)
        _check_buffers((work, work_grad, *moments, scalars, *tables), block)
        self.function(
            work.data_ptr(),
            work_grad.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_scale.data_ptr(),
            exp_avg_sq.data_ptr(),
            exp_avg_sq_scale.data_ptr(),
            rows,
            cols,
            block[0],
            block[1],
            scalars.data_ptr(),
            *(table.data_ptr() for table in tables),
            _FLOAT_DTYPES[work.dtype],
            _num_threads(rows * cols),
        )
        if work is not param:
            param.copy_(work)


_BUFFER_NAMES = (
    "param",
    "grad",
    "exp_avg",
    "exp_avg_sq",
    "exp_avg_scale",
    "exp_avg_sq_scale",
    "scalars",
    "signed_map",
    "unsigned_map",
    "signed_lookup",
    "unsigned_lookup",
)


def _check_buffers(buffers: tuple[torch.Tensor, ...], block: tuple[int, int]) -> None:
    """Every buffer the kernel touches through a raw pointer: dtype, device, size, layout.

    The C++ side trusts its pointers, so a wrong size here would be a heap overrun in a
    rank, which surfaces much later as an unrelated crash; it is checked before each call
    (about 5 us: a few attribute reads per buffer, the message built only on failure).

    Args:
        buffers: The tensors named in `_BUFFER_NAMES`, in that order.
        block: The quantization block (rows, cols).
    """
    param = buffers[0]
    if param.dim() != 2:
        raise ValueError(f"the CPU kernel takes a 2-D piece, got shape {tuple(param.shape)}")
    rows, cols = param.shape
    block_rows, block_cols = block
    if block_rows <= 0 or block_cols <= 0:
        raise ValueError(f"block must be positive, got {block}")
    numel, grid = rows * cols, -(-rows // block_rows) * -(-cols // block_cols)
    f32, u8, i32 = torch.float32, torch.uint8, torch.int32
    dtypes = (param.dtype, param.dtype, u8, u8, f32, f32, f32, f32, f32, i32, i32)
    sizes = (numel,) * 4 + (grid, grid, _NUM_SCALARS, 256, 256, _LOOKUP_SIZE, _LOOKUP_SIZE)
    for name, tensor, dtype, size in zip(_BUFFER_NAMES, buffers, dtypes, sizes, strict=True):
        if tensor.dtype is dtype and tensor.numel() == size and tensor.is_cpu:
            if tensor.is_contiguous():
                continue
            raise ValueError(f"the CPU kernel's {name} must be contiguous (it is read by pointer)")
        raise ValueError(
            f"the CPU kernel's {name} must be {size} {dtype} elements on cpu for a {rows} x "
            f"{cols} piece in {block_rows} x {block_cols} blocks, got {tensor.numel()} "
            f"{tensor.dtype} on {tensor.device}"
        )


def _num_threads(numel: int) -> int:
    # A thread costs tens of microseconds to start: give each at least 256K elements.
    return max(1, min(torch.get_num_threads(), numel >> 18))


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    raise NativeKernelError("no C++ compiler found (set CXX, or install g++ or clang++)")


def _cpu_identity() -> str:
    try:  # Linux: the instruction sets -march=native compiles for
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _cache_dir() -> Path:
    configured = os.environ.get("RAGGED_OPTIMIZERS_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ragged_optimizers"


@functools.cache
def load_cpu_kernel() -> CpuKernel:
    """Builds (or finds in the cache) and loads the CPU kernel, once per process.

    Raises:
        NativeKernelError: No compiler, a failed build, or a library that does not load.

    Example:
        >>> kernel = load_cpu_kernel()
        >>> kernel.library.name.startswith("adamw8bit_cpu_"), kernel.library.suffix
        (True, '.so')
    """
    start = time.perf_counter()
    compiler = _compiler()
    source = _SOURCE.read_bytes()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeKernelError(f"{compiler} --version failed: {error}") from error
    key = hashlib.sha256(
        b"\0".join(
            part.encode() if isinstance(part, str) else part
            for part in (source, compiler, version, " ".join(_FLAGS), _cpu_identity())
        )
    ).hexdigest()[:24]
    library = _cache_dir() / f"adamw8bit_cpu_{key}.so"
    if not library.exists():
        _build(compiler, library)
    try:
        function = ctypes.CDLL(str(library)).ragged_adamw8bit_update
    except (OSError, AttributeError) as error:
        raise NativeKernelError(f"could not load {library}: {error}") from error
    function.restype = None
    pointer, size, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    function.argtypes = [pointer] * 6 + [size] * 4 + [pointer] * 5 + [flag, flag]
    return CpuKernel(function, library, time.perf_counter() - start)


def _build(compiler: str, library: Path) -> None:
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: ranks building at once never load a
        # half-written file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
    except OSError as error:
        message = f"cannot write the kernel cache {library.parent}: {error}"
        raise NativeKernelError(message) from error
    command = [compiler, *_FLAGS, str(_SOURCE), "-o", partial]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise NativeKernelError(
                f"{' '.join(command)} failed ({result.returncode}): {result.stderr[-2000:]}"
            )
        os.replace(partial, library)
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeKernelError(f"{' '.join(command)} failed: {error}") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
