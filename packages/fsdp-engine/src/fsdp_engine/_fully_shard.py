"""`fully_shard`: FSDP2's entry point, with one planned DBuffer per group and dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, TypeVar, Unpack, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from fsdp_engine._compat import fully_shard_state, mark_fsdp_managed, set_fully_shard_state
from fsdp_engine._gather_format import GatherFormatArg
from fsdp_engine._group import adopt_assigned
from fsdp_engine._init import BlockRowsArg, check_modules, init_state
from fsdp_engine._module import FSDPModule, state_of
from fsdp_engine._param_dtypes import OverrideFn
from fsdp_engine._state import STATE_ATTR, FSDPState

M = TypeVar("M", bound=nn.Module)

_CLASS_CACHE: dict[type, type] = {}


class _ShardOptions(TypedDict, total=False):
    """`fully_shard`'s keywords, for its overloads (the implementation spells them out)."""

    mesh: DeviceMesh | None
    reshard_after_forward: bool | int | None
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: set[nn.Parameter] | None
    block_rows: BlockRowsArg
    dp_mesh_dims: Any
    gather_format: GatherFormatArg
    param_dtype_override_fn: OverrideFn | None


@overload
def fully_shard(module: M, **options: Unpack[_ShardOptions]) -> M: ...


@overload
def fully_shard(module: list[nn.Module], **options: Unpack[_ShardOptions]) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen, as FSDP2)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    block_rows: BlockRowsArg = None,
    dp_mesh_dims: Any = None,
    gather_format: GatherFormatArg = None,
    param_dtype_override_fn: OverrideFn | None = None,
) -> nn.Module | list[nn.Module]:
    """Shards `module`'s parameters (those no nested call took) into one group, as FSDP2 does.

    Call it bottom-up (each block, then the root). Between iterations the parameters are
    RaggedShard DTensors over one planned buffer per dtype (a DBuffer); forward and backward
    gather the group in place and gradients are reduce-scattered from one buffer, with no
    copy-in or copy-out. The module's class becomes `FSDP<Name>`, with FSDPModule's methods.

    Args:
        module: A module, or a list of modules that form one group (e.g. `[norm, output]`).
        mesh: 1-D (FSDP) or 2-D (replicate, shard) = HSDP. None: a 1-D mesh over the default
            process group, initialized from torchrun's environment if needed. Parameters that
            are DTensors (tensor or expert parallel, applied first) must be over other named
            axes of the same device mesh: their local pieces are sharded over `mesh`, and
            the sharded parameters are DTensors over `mesh`'s axes followed by theirs.
        reshard_after_forward: Free the gathered parameters after forward. None: True except
            for the root. An int k (a divisor of the shard axis size, as FSDP2's): keep 1/k
            of the gathered parameters after forward, so that backward gathers over k
            consecutive ranks only (e.g. one node's); 1 is False, the axis size is True.
        shard_placement_fn: FSDP2's per-parameter placement. None or Shard(0): RaggedShard
            over whole rows (of `shape[1:]`). Shard(d): shard boundaries may also cut dims
            1..d (rows of `shape[d + 1:]`), which balances a tensor with fewer rows than
            ranks, e.g. experts (E, H, F) with E < world size and Shard(1); every rank still
            holds one contiguous range of the row-major tensor (RaggedShard(dims=(0..d))),
            not FSDP2's chunk of dim d. torch's `ShardPlacementResult` (torch 2.13+) puts a
            parameter on its own mesh (1-D, or 2-D for HSDP); the group keeps one DBuffer per
            mesh and dtype.
        mp_policy: Mixed precision (param_dtype, reduce_dtype, output_dtype,
            cast_forward_inputs), as in FSDP2.
        offload_policy: OffloadPolicy() (none) or CPUOffloadPolicy(pin_memory=...): the
            sharded parameters and their gradients live in host memory and the optimizer
            steps them there (`_offload.py`).
        ignored_params: Parameters left unsharded and untouched.
        block_rows: Rows per block that no shard boundary may cut: an int, a mapping from
            parameter FQN (relative to `module`; "i.fqn" for the i-th module of a list) to
            int, or a function of (fqn, param). Default 1: every rank holds whole rows.
        dp_mesh_dims: torch's `DataParallelMeshDims` (torch 2.13+): `mesh` is then the full
            SPMD mesh (data and tensor parallel axes, named), `shard` names the axis or axes
            to shard over (several are flattened into one) and `replicate` the HSDP axis or
            axes. DTensor parameters on `mesh` must be Replicate on those axes; forward and
            backward see them as given (on `mesh`).
        gather_format: `dbuffer.BlockFloat8(block=(rows, cols))`: all-gather the parameters
            of 2+ dims as fp8 codes with one scale per block (about half the bytes of bf16),
            dequantized into param_dtype; their block_rows default to the block's rows so
            that shards hold whole blocks. Or a function of (fqn, param) returning a
            BlockFloat8 or None (`_gather_format.py`).
        param_dtype_override_fn: torch 2.15's `MixedPrecisionPolicy` field, on any torch
            (here or in mp_policy): per parameter None, param_dtype or its own dtype (an fp32
            norm among bf16 matrices). One gather per compute dtype (`_param_dtypes.py`).

    A frozen parameter whose class implements FSDP2's all-gather extension
    (`fsdp_pre_all_gather` / `fsdp_post_all_gather`, e.g. torchao's NF4Tensor) is sharded
    and gathered as FSDP2 does: an even Shard(0) chunk cut by its class, gathered through its
    hooks, outside the group's DBuffers (`_subclass.py`).

    Returns:
        The same module (or list), now FSDPModule(s).

    Example:
        >>> for block in model.layers:
        ...     _ = fully_shard(block, block_rows=4)  # no shard boundary cuts 4 rows
        >>> model = fully_shard(model)
        >>> type(model.layers[0]).__name__, model.layers[0].weight.placements
        ('FSDPLinear', (RaggedShard(dims=(0,), local_units=(2,)),))
    """
    modules = check_modules(module)
    state = init_state(
        modules,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        block_rows=block_rows,
        dp_mesh_dims=dp_mesh_dims,
        gather_format=gather_format,
        param_dtype_override_fn=param_dtype_override_fn,
    )
    for mod in modules:
        _install(mod, state)
        mark_fsdp_managed(mod)  # as torch's fully_shard does (transformers and dynamo read it)
    return module


# torch's `fully_shard.state(module)`, which torch's pipeline stages call on every FSDPModule:
# a module bound to `fully_shard` before a user rebinds torch's name to ours (pipelining binds
# it at import) must still find it.
fully_shard.state = fully_shard_state  # type: ignore[attr-defined]


def _install(module: nn.Module, state: FSDPState) -> None:
    cls = type(module)
    fsdp_cls = _CLASS_CACHE.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLASS_CACHE[cls] = fsdp_cls
    module.__class__ = fsdp_cls
    setattr(module, STATE_ATTR, state)

    def pre_forward(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return state.pre_forward(mod, args, kwargs)

    def post_forward(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return state.post_forward(mod, output)

    module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(post_forward, prepend=False)
    set_fully_shard_state(module, state.post_backwards_under_root, state.end_of_iteration)
    # state_dict() and load_state_dict() see (and load into) the sharded parameters; what
    # load_state_dict(assign=True) puts in their place is copied into them.
    module.register_state_dict_pre_hook(lambda *_: _reshard(state))  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(lambda *_: _reshard(state))  # type: ignore[no-untyped-call]
    module.register_load_state_dict_post_hook(lambda mod, _: _adopt(state, mod))  # type: ignore[no-untyped-call]


def _reshard(state: FSDPState) -> None:
    if state.group is not None:
        state.group.reshard()


def _adopt(state: FSDPState, module: nn.Module) -> None:
    if state.group is not None:
        adopt_assigned(state.group, set(module.modules()))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes `module.method_name(...)` gather and free parameters as `forward` does.

    Args:
        module: An FSDPModule.
        method_name: The name of a method other than `forward` (e.g. "generate").

    Example:
        >>> model = fully_shard(model)
        >>> register_fsdp_forward_method(model, "generate")
        >>> model.generate(torch.randn(1, 8)).shape
        torch.Size([1, 8])
    """
    state = state_of(module)
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, method(*args, **kwargs))

    setattr(module, method_name, wrapped)
