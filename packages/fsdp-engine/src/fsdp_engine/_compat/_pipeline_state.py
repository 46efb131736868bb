"""What torch's pipeline stages read of FSDP2's private state, imitated for our modules.

torch's `PipelineStage` finishes each FSDP module's backward itself at the end of a schedule:
it looks the module's state up with `fully_shard.state(module)` (the private registry of
torch's composable APIs) and calls what it finds there. So that a schedule drives ours, each
of our modules registers, under torch's own key, a view that forwards to our state:

What the stage reads on the state, by torch version (the views here answer both forms):
- 2.10: `_state_ctx.all_states[i]._fsdp_param_group.post_backward()` for each state, then
  `_root_post_backward_final_callback()` (`_GroupView._fsdp_param_group`);
- 2.11 to 2.15.0: the same through `_fsdp_param_groups[j]` (`_GroupView._fsdp_param_groups`);
  torch 2.15's schedules call `finalize_backward()` on the module instead where it has one,
  which ours does (this view then goes unused).

The key is found once by probing torch's function (`_KeyProbe`), not by naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from torch import nn


class _KeyProbe(dict[Any, Any]):
    """Records the key `fully_shard.state` looks a module's state up by."""

    key: Any = None

    def get(self, key: Any, default: Any = None) -> Any:
        self.key = key
        return default


def _torch_fully_shard() -> Any:
    # From its defining module: a user may have rebound `torch.distributed.fsdp.fully_shard`
    # to ours (the drop-in swap), and the registry belongs to torch's function.
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard

    return fully_shard


@functools.cache
def _fully_shard_state_key() -> Any:
    from torch.distributed._composable.contract import STATE_KEY

    module = nn.Module()
    probe = _KeyProbe()
    module.__dict__[STATE_KEY] = probe
    _torch_fully_shard().state(module)
    return STATE_KEY, probe.key


def fully_shard_state(module: nn.Module) -> Any:
    """`torch.distributed.fsdp.fully_shard.state(module)`, looked up by torch's own function."""
    return _torch_fully_shard().state(module)


class _GroupView:
    """One FSDP state as torch's pipeline stage sees it: `._fsdp_param_group(s)`."""

    def __init__(self, post_backward: Callable[[], None] | None) -> None:
        self._post_backward = post_backward
        self._fsdp_param_group = self if post_backward is not None else None  # torch 2.10
        self._fsdp_param_groups = [self] if post_backward is not None else []  # 2.11-2.14

    def post_backward(self) -> None:
        assert self._post_backward is not None
        self._post_backward()


class _StateView:
    """`fully_shard.state(root)` as torch 2.10-2.15.0's pipeline stages use it."""

    def __init__(
        self,
        post_backwards: Callable[[], list[Callable[[], None] | None]],
        final_callback: Callable[[], None],
    ) -> None:
        self._post_backwards = post_backwards
        self._root_post_backward_final_callback = final_callback

    @property
    def _state_ctx(self) -> SimpleNamespace:
        # torch's FSDPStateContext, of which the stage reads `all_states` only.
        return SimpleNamespace(all_states=[_GroupView(fn) for fn in self._post_backwards()])


def set_fully_shard_state(
    module: nn.Module,
    post_backwards: Callable[[], list[Callable[[], None] | None]],
    final_callback: Callable[[], None],
) -> None:
    """Makes `torch.distributed.fsdp.fully_shard.state(module)` drive ours.

    Args:
        module: A module fully_shard applied to.
        post_backwards: Returns, for every FSDP state under the module's root, its
            post-backward (None for a state without parameters).
        final_callback: What runs at the end of backward (wait for the reduces, hand out
            the gradients, reset the iteration).
    """
    state_key, key = _fully_shard_state_key()
    module.__dict__.setdefault(state_key, {})[key] = _StateView(post_backwards, final_callback)
