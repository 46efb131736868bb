"""ragged_optimizers: distributed Muon and block-wise 8-bit AdamW on sharded parameters.

Both optimizers take plain tensors (one process), RaggedShard DTensors (DBuffer, fsdp_engine)
and Shard(0) DTensors (FSDP2). `Muon` orthogonalizes each sharded matrix once, on one owner
chosen by a plan every rank computes alike; `AdamW8bit` keeps both moments in 8 bits with one
scale per 2-D block, which shards cut only between blocks, so its state is the same bits on
any number of ranks.

Example:
    >>> layer = torch.nn.Linear(64, 64)
    >>> opt = Muon([{"params": [layer.weight]}, {"params": [layer.bias], "use_muon": False}])
    >>> layer(torch.randn(8, 64)).sum().backward()
    >>> opt.step()
"""

from ragged_optimizers._adamw8bit import AdamW8bit
from ragged_optimizers._flat_adamw import AdamW
from ragged_optimizers._muon import Muon
from ragged_optimizers._muon_exchange import matrix_shape
from ragged_optimizers._newton_schulz import newton_schulz, resolve_coefficients
from ragged_optimizers._owner_plan import (
    MatrixAssignment,
    OwnerPlan,
    makespan,
    ns_flops,
    plan_owners,
)
from ragged_optimizers._quantize import dequantize, dynamic_map, quantize

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "AdamW8bit",
    "MatrixAssignment",
    "Muon",
    "OwnerPlan",
    "__version__",
    "dequantize",
    "dynamic_map",
    "makespan",
    "matrix_shape",
    "newton_schulz",
    "ns_flops",
    "plan_owners",
    "quantize",
    "resolve_coefficients",
]
