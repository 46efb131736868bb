"""The autograd glue of the schedule: where FSDP learns that a module's backward is done.

`PostBackward` is an identity on a module's inputs whose backward runs once autograd is done
with the module (every input gradient is ready): FSDP2's post-backward signal. Hooks on a
module's outputs fire when the first gradient reaches them: the pre-backward signal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fsdp_engine._compat import map_tensors


class _PostBackwardRunner(Protocol):
    def post_backward(self) -> None: ...


class PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs after the module's backward."""

    @staticmethod
    def forward(
        ctx: Any, state: _PostBackwardRunner, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)

    @classmethod
    def route(
        cls, state: _PostBackwardRunner, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves: list[torch.Tensor] = []
        _visit((args, kwargs), lambda t: leaves.append(t) if t.requires_grad else None)
        if not leaves:
            return args, kwargs
        routed = iter(cls.apply(state, *leaves))  # type: ignore[no-untyped-call]
        new_args, new_kwargs = map_tensors(
            (args, kwargs), lambda t: next(routed) if t.requires_grad else t
        )
        return new_args, new_kwargs


def hook_outputs(
    output: Any,
    hook: Callable[[torch.Tensor], torch.Tensor],
    on_hooked: Callable[[], None] | None = None,
) -> Any:
    def register(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(hook)  # type: ignore[no-untyped-call]
            if on_hooked is not None:
                on_hooked()
        return t

    return map_tensors(output, register)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(tree, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _visit(tree: Any, fn: Callable[[torch.Tensor], object]) -> None:
    map_tensors(tree, lambda t: (fn(t), t)[1])
