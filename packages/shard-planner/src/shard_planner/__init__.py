"""shard_planner: structure-aware layout planning for sharded communication buffers.

Pure Python, no dependencies: give it the tensors of one group (element counts and the block
size that must never be cut) and a world size, and it returns where each tensor lives in one
evenly sharded buffer, with as little padding as it can find. See `plan_layout`.

Example:
    >>> from shard_planner import TensorSpec, plan_layout
    >>> specs = [TensorSpec.from_shape("w1", (1009, 64), block_rows=32),
    ...          TensorSpec.from_shape("b1", (64,))]
    >>> layout = plan_layout(specs, world_size=4)
    >>> layout.local_units("w1")
    (256, 256, 256, 241)
"""

from shard_planner._activations import ActivationModel
from shard_planner._advise import Candidate, advise, factorisations
from shard_planner._baselines import flat_padding, fsdp2_padding, fsdp2_whole_block_padding
from shard_planner._bounds import lower_bound
from shard_planner._compute import ComputeModel
from shard_planner._estimate import Estimate, estimate
from shard_planner._estimate_checks import OPTIMIZERS
from shard_planner._granularity import fully_shard_calls, split_experts
from shard_planner._layout import Layout, LayoutError, dump_plan, load_plan
from shard_planner._links import Links, fit_links, link_profile_names, load_links
from shard_planner._peak import Peak
from shard_planner._plan import ORDERS, plan_layout
from shard_planner._presets import (
    GroupSpec,
    ModelPreset,
    load_group_file,
    load_preset,
    parse_model,
    preset_names,
)
from shard_planner._report import explain_padding
from shard_planner._spec import TensorSpec

__version__ = "0.1.0"

__all__ = [
    "OPTIMIZERS",
    "ORDERS",
    "ActivationModel",
    "Candidate",
    "ComputeModel",
    "Estimate",
    "GroupSpec",
    "Layout",
    "LayoutError",
    "Links",
    "ModelPreset",
    "Peak",
    "TensorSpec",
    "__version__",
    "advise",
    "dump_plan",
    "estimate",
    "explain_padding",
    "factorisations",
    "fit_links",
    "flat_padding",
    "fsdp2_padding",
    "fsdp2_whole_block_padding",
    "fully_shard_calls",
    "link_profile_names",
    "load_group_file",
    "load_links",
    "load_plan",
    "load_preset",
    "lower_bound",
    "parse_model",
    "plan_layout",
    "preset_names",
    "split_experts",
]
