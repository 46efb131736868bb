"""fsdp_engine: `fully_shard` with FSDP2's API, backed by planned zero-copy buffers.

Switch `from torch.distributed.fsdp import fully_shard` to `from fsdp_engine import
fully_shard`: each call puts its group's parameters in one planned buffer per dtype (a DBuffer),
shards it with RaggedShard (whole rows, or whole blocks of `block_rows` rows, per rank), and
runs the all-gather and reduce-scatter in place on that buffer.

Example (`model`: a module with a list of blocks in `model.layers`):
    >>> import torch
    >>> from fsdp_engine import MixedPrecisionPolicy, fully_shard
    >>> mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> for block in model.layers:
    ...     _ = fully_shard(block, mp_policy=mp)
    >>> model = fully_shard(model, mp_policy=mp)
    >>> model(torch.randn(2, 8)).float().sum().backward()
    >>> model.layers[0].weight.grad.dtype  # sharded, in the parameter's dtype
    torch.float32
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_engine._clip import clip_grad_norm_
from fsdp_engine._fully_shard import fully_shard, register_fsdp_forward_method
from fsdp_engine._module import FSDPModule, GradientReductionHandle, UnshardHandle
from fsdp_engine._offload import OptimizerStateOffload, offload_within_budget
from fsdp_engine._summary import GroupSummary, sharding_summary

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "GradientReductionHandle",
    "GroupSummary",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimizerStateOffload",
    "UnshardHandle",
    "__version__",
    "clip_grad_norm_",
    "fully_shard",
    "offload_within_budget",
    "register_fsdp_forward_method",
    "sharding_summary",
]
