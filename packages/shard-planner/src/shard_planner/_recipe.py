"""The first plan of `advise` as code: meshes, mixed precision, the bound `fully_shard`, calls.

What `shard-planner advise` prints under "the first plan as code": Python that runs as it is
on every rank, once the model is built (as `model`) and torch.distributed is initialized on
the plan's number of ranks. Expert parallelism's split of the experts over the 'ep' axis and
activation checkpointing are model code of their own: the recipe says where they go.
"""

from __future__ import annotations

from collections.abc import Sequence

from shard_planner._advise import Candidate
from shard_planner._cost_report import checkpointed_blocks, memory_parts
from shard_planner._expert_parallel import expert_groups_under_ep
from shard_planner._granularity import fully_shard_calls, split_experts
from shard_planner._presets import GroupSpec

_DTYPES = {2: "torch.bfloat16", 4: "torch.float32", 8: "torch.float64"}


def setup_lines(
    candidate: Candidate, block_rows: int, *, param_bytes: int, compute_bytes: int | None
) -> list[str]:
    """The imports, meshes and the `fully_shard` with the plan's settings bound.

    Example:
        >>> from shard_planner import advise, load_preset
        >>> best = advise(load_preset("llama3-8b").groups, num_ranks=16, ranks_per_node=8,
        ...               memory_bytes=80 * 2**30)[0]
        >>> for line in setup_lines(best, 1, param_bytes=4, compute_bytes=2)[-9:]:
        ...     print(line)
        mesh = init_device_mesh("cuda", (2, 8), mesh_dim_names=("replicate", "shard"))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard = functools.partial(
            fsdp_fully_shard,
            mesh=mesh,
            mp_policy=mp_policy,
            block_rows=1,
            reshard_after_forward=False,
        )
    """
    est = candidate.estimate
    replicas, shards = candidate.replicate_size, candidate.shard_size
    compute = _DTYPES.get(compute_bytes or param_bytes)
    reduce = _DTYPES.get(candidate.grad_bytes)
    lines = [
        "import functools",
        "",
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        "",
        "from fsdp_engine import MixedPrecisionPolicy",
        "from fsdp_engine import fully_shard as fsdp_fully_shard",
        "",
        _mesh("mesh", replicas, shards, ("replicate", "shard")),
    ]
    ep, dense = est.expert_parallel, est.dense_shard_size
    if ep > 1:
        dp = shards // ep
        lines.append(_mesh("ep_mesh", replicas, (dp, ep), ("replicate", "dp", "ep")))
        lines.append(
            'experts_mesh = ep_mesh["replicate", "dp"]' if replicas > 1
            else 'experts_mesh = ep_mesh["dp"]'
        )  # fmt: skip
        lines.append(
            f"# expert parallelism: split each block's experts over ep_mesh['ep'] first (each "
            f"rank keeps its 1/{ep}, numbered from 0), e.g. with torchtitan's ExpertParallel"
        )
    if dense is not None:
        lines.append(_mesh("dense_mesh", shards * replicas // dense, dense, ("replicate", "shard")))
    if compute_bytes in (None, param_bytes) and candidate.grad_bytes == param_bytes:
        lines.append("mp_policy = MixedPrecisionPolicy()")
    else:
        lines.append(
            f"mp_policy = MixedPrecisionPolicy(param_dtype={compute}, reduce_dtype={reduce})"
        )
    reshard = "True" if est.reshard_after_forward else "False"
    bound = "shard" if est.prefetch > 1 else "fully_shard"
    lines += [
        f"{bound} = functools.partial(",
        "    fsdp_fully_shard,",
        "    mesh=mesh,",
        "    mp_policy=mp_policy,",
        f"    block_rows={block_rows},",
        f"    reshard_after_forward={reshard},",
        ")",
    ]
    if est.prefetch > 1:  # each call's module is kept for the prefetch settings at the end
        lines += [
            "made = []",
            "",
            "",
            "def fully_shard(module, **kwargs):",
            "    made.append(module[0] if isinstance(module, list) else module)",
            "    return shard(module, **kwargs)",
            "",
            "",
        ]
    if est.checkpointing:
        which = checkpointed_blocks(est)
        lines.append(f"# activation checkpointing of {which} first (checkpoint_wrapper)")
    return lines


def prefetch_lines(depth: int, root: str = "model") -> list[str]:
    r"""Code making each group prefetch `depth` groups ahead (forward) and behind (backward).

    The groups are the modules `made` holds (each `fully_shard` call's, recorded by the
    setup's wrapper), in `root.modules()`'s order: a model's forward order when its blocks
    are registered in the order they run. The lines run after the calls.

    Example:
        >>> print("\n".join(prefetch_lines(2)[-3:]))
        for i, group in enumerate(groups):
            group.set_modules_to_forward_prefetch(groups[i + 1 : i + 3])
            group.set_modules_to_backward_prefetch(groups[max(i - 2, 0) : i][::-1])
    """
    return [
        f"# each group gathers the next {depth} ahead in forward, the last {depth} in backward",
        f"order = {{id(m): i for i, m in enumerate({root}.modules())}}",
        f"groups = sorted((m for m in made if m is not {root}), key=lambda m: order[id(m)])",
        "for i, group in enumerate(groups):",
        f"    group.set_modules_to_forward_prefetch(groups[i + 1 : i + {depth + 1}])",
        f"    group.set_modules_to_backward_prefetch(groups[max(i - {depth}, 0) : i][::-1])",
    ]


def _mesh(name: str, outer: int, inner: int | tuple[int, ...], names: tuple[str, ...]) -> str:
    shape = (outer, *(inner if isinstance(inner, tuple) else (inner,)))
    if outer == 1:  # no replicas: the axes below
        shape, names = shape[1:], names[1:]
    dims = ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
    quoted = ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "")
    return f'{name} = init_device_mesh("cuda", ({dims}), mesh_dim_names=({quoted}))'


def layout_lines(
    candidate: Candidate,
    groups: Sequence[GroupSpec],
    block_rows: int,
    *,
    param_bytes: int = 4,
    compute_bytes: int | None = None,
) -> list[str]:
    """How to build a plan: its memory by part, then the recipe (setup and calls) as code."""
    est = candidate.estimate
    grouped = split_experts(groups, candidate.expert_groups)
    assert grouped is not None  # advise made it
    if est.expert_parallel > 1:  # what one rank holds: its 1/e of each block's experts
        grouped = tuple(expert_groups_under_ep(grouped, est.expert_parallel)[0])
    code = setup_lines(candidate, block_rows, param_bytes=param_bytes, compute_bytes=compute_bytes)
    code += fully_shard_calls(
        grouped,
        experts_mesh="experts_mesh" if est.expert_parallel > 1 else None,
        dense_mesh="dense_mesh" if est.dense_shard_size is not None else None,
    )
    if est.prefetch > 1:
        code += prefetch_lines(est.prefetch)
    lines = [
        f"memory of the first, per rank: {memory_parts(est)}",
        f"the first plan as code ({candidate.replicate_size * candidate.shard_size} ranks, "
        f"`model` built, torch.distributed initialized):",
        *(f"    {line}" if line else "" for line in code),
    ]
    if est.step_time_s and est.comm_time_s > 3 * est.compute_time_s:
        lines.append(
            f"note: communication is {est.comm_time_s / est.compute_time_s:.0f}x the "
            f"compute of {est.compute_time_s:.2f} s per step: FSDP sends each parameter "
            f"three times per step (two gathers, one reduce), so with this few tokens "
            f"per rank no mesh split or grouping hides it; more tokens per rank, or "
            f"expert parallelism (--expert-parallel, priced with --top-k), is the lever"
        )
    if candidate.expert_groups:
        lines.append(
            "note: an expert group gathers when one of its experts runs: every rank must "
            "run each group (call every expert, with no tokens if none are routed)"
        )
    return lines
