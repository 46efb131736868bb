"""Activation memory per rank from the model's shapes, with and without checkpointing.

What backward needs from forward, per token, read off each group's tensors:
- a weight matrix (a matmul: `out x in`, embeddings aside) keeps its input and its output
  (`in + out`: the output is what the next elementwise op, an activation function, a gate
  product, attention, saves); routed experts count `top_k` of the model's experts;
- a 1-D weight (a norm's scale) keeps the norm's input (its length);
- an embedding keeps its output row (its width).
A SwiGLU MLP of width f on hidden size h comes to 3h + 3f against the h + 4f it saves in
torch, attention with fused q/k/v to 6h (queries, keys, values, the attention output and the
two inputs); attention scores are not kept (flash / memory-efficient attention), and the
logits count as the head's output, in the compute dtype (a loss that upcasts them to fp32
doubles that part). That is what fused kernels keep; code written op by op (a norm as pow,
mean, rsqrt and two products, rotary as slices and products) keeps more: `scale` multiplies
the count by the ratio measured on the model's own code (the example decoder of the source
repository: 1.25 dense, 1.28 MoE).

The loss: a cross-entropy that upcasts the logits to fp32 (torch's `cross_entropy` on
`logits.float()`, as torchtitan and transformers compute it) holds, in its backward, the
log-softmax output it saved, that output's gradient and the logits' gradient, 4 bytes each
per logit: `loss_bytes_per_logit` 12 (0 for a fused or chunked loss that never holds them).
The vocabulary is the first dim of the embedding (a 2-D tensor named `embed`). That peak
comes first in backward, with every kept activation alive but before any block recomputes.

One micro-batch's activations are alive at once (`seq_len x micro_batch` tokens): gradient
accumulation frees each before the next. With activation checkpointing on every block (a
group named with a block index, `layers.7`, and the expert groups split off it), a block keeps
only its input (its hidden size, the longest 1-D tensor it holds) and the largest block's
activations are alive again while its backward recomputes them; the forward runs twice for
those blocks (compute x 4/3).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from shard_planner._compute import routed_share
from shard_planner._granularity import block_index, classify
from shard_planner._presets import GroupSpec
from shard_planner._spec import check_count

RECOMPUTE = 4 / 3  # a checkpointed block's compute: forward (1/3) again before backward (2/3)


@dataclass(frozen=True)
class ActivationModel:
    """The batch one rank runs, for the activations it keeps.

    Attributes:
        seq_len: Tokens per sequence.
        micro_batch: Sequences per micro-batch (one micro-batch's activations are alive).
        top_k: Routed experts each token runs (needed when the model has experts).
        checkpointing: Activation checkpointing of blocks (see `checkpoint_ratio`).
        checkpoint_ratio: With checkpointing, (p, q): p of every q blocks, spread evenly
            (block i when (i + 1) * p // q > i * p // q; (1, 1): every block, (1, 2): every
            other one, as torchtitan's selective layer AC); the others keep their
            activations and are not recomputed.
        scale: Measured activations over this count for the model's kernels (1: fused).
        loss_bytes_per_logit: Bytes the loss holds per logit at its backward (12: an fp32
            cross-entropy's log-softmax output, its gradient and the logits' gradient).

    Example:
        >>> layer = GroupSpec.from_shapes("layers.0", {"layers.0.norm.weight": (64,),
        ...                                            "layers.0.mlp.w1.weight": (256, 64)})
        >>> ActivationModel(seq_len=1024).bytes_for([layer], compute_bytes=2)  # (64+64+256) x 2 B
        786432
    """

    seq_len: int
    micro_batch: int = 1
    top_k: int | None = None
    checkpointing: bool = False
    scale: float = 1.0
    loss_bytes_per_logit: int = 12
    checkpoint_ratio: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        check_count("seq_len", self.seq_len, 1)
        check_count("micro_batch", self.micro_batch, 1)
        if self.top_k is not None:
            check_count("top_k", self.top_k, 1)
        if not isinstance(self.checkpointing, bool):
            raise TypeError(f"checkpointing must be a bool, got {self.checkpointing!r}")
        scale: object = self.scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < 1e6:
            raise ValueError(f"scale must be a positive number, got {scale!r}")
        check_count("loss_bytes_per_logit", self.loss_bytes_per_logit, 0)
        check_ratio(self.checkpoint_ratio)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.seq_len * self.micro_batch

    def bytes_for(self, groups: Sequence[GroupSpec], *, compute_bytes: int) -> int:
        """Peak activation bytes of one micro-batch over `groups` (module docstring)."""
        share = routed_share(groups, self.top_k)
        ratio = self.checkpoint_ratio if self.checkpointing else None
        kept, block_inputs, recomputed = _per_token(tuple(groups), share, ratio)
        loss = vocab_size(groups) * self.loss_bytes_per_logit
        always = (kept * self.scale + block_inputs) * compute_bytes
        # The loss's backward comes before any block's: the two peaks do not meet.
        return round(self.tokens * (always + max(recomputed * self.scale * compute_bytes, loss)))

    def by_group(
        self, groups: Sequence[GroupSpec], *, compute_bytes: int
    ) -> tuple[list[int], list[int]]:
        """Each group's activations of one micro-batch: (kept, alive only in its backward).

        Kept: what the group's forward leaves for its backward (a checkpointed block: its
        input, on the block's first group). Alive only in its backward: a checkpointed
        block's activations, recomputed (on each of the block's groups), and on the last
        group, whose backward comes first, the loss's bytes. Summed as `bytes_for` sums them,
        the kept bytes and the largest of the others are its count.

        Example:
            >>> layer = GroupSpec.from_shapes("layers.0", {"layers.0.w.weight": (256, 64)})
            >>> ActivationModel(seq_len=8, checkpointing=True).by_group([layer], compute_bytes=2)
            ([1024], [5120])
        """
        check_count("compute_bytes", compute_bytes, 1)
        kept, extra = _by_group(self, tuple(groups), compute_bytes)
        return list(kept), list(extra)


@functools.lru_cache(maxsize=256)  # advise asks at every split for the same groups and model
def _by_group(
    model: ActivationModel, groups: tuple[GroupSpec, ...], compute_bytes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`ActivationModel.by_group`'s count."""
    share = routed_share(groups, model.top_k)
    ratio = model.checkpoint_ratio if model.checkpointing else None
    per_token = [_kept_per_token(g, share) * model.scale * compute_bytes for g in groups]
    index = [block_index(g.name) for g in groups]
    checkpointed = [is_checkpointed(i, ratio) for i in index]
    block_total: dict[int | None, float] = {}
    block_input: dict[int | None, int] = {}
    for group, i, kept, again in zip(groups, index, per_token, checkpointed, strict=True):
        if again:
            block_total[i] = block_total.get(i, 0.0) + kept
            block_input[i] = max(block_input.get(i, 0), _input_width(group))
    kept_out: list[int] = []
    extra_out: list[int] = []
    for i, kept, again in zip(index, per_token, checkpointed, strict=True):
        if again:  # the input once, on the block's first group
            width = block_input.pop(i, 0)
            kept_out.append(round(model.tokens * width * compute_bytes))
            extra_out.append(round(model.tokens * block_total[i]))
        else:
            kept_out.append(round(model.tokens * kept))
            extra_out.append(0)
    if groups:
        loss = model.tokens * vocab_size(groups) * model.loss_bytes_per_logit
        extra_out[-1] = max(extra_out[-1], loss)
    return tuple(kept_out), tuple(extra_out)


def check_ratio(ratio: object) -> tuple[int, int]:
    """A checkpoint ratio (p, q): integers with 1 <= p <= q <= 64.

    Example:
        >>> check_ratio((0, 2))
        Traceback (most recent call last):
        ...
        ValueError: checkpoint_ratio must be (p, q), integers with 1 <= p <= q <= 64, got (0, 2)
    """
    ok = (
        isinstance(ratio, tuple)
        and len(ratio) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in ratio)
        and 1 <= ratio[0] <= ratio[1] <= 64
    )
    if not ok:
        raise ValueError(
            f"checkpoint_ratio must be (p, q), integers with 1 <= p <= q <= 64, got {ratio!r}"
        )
    return ratio  # type: ignore[return-value]


def is_checkpointed(index: int | None, ratio: tuple[int, int] | None) -> bool:
    """Whether block `index` (None: not a block) is checkpointed, p of every q spread evenly.

    Example:
        >>> [is_checkpointed(i, (3, 4)) for i in range(5)], is_checkpointed(None, (1, 1))
        ([False, True, True, True, False], False)
    """
    if index is None or ratio is None:
        return False
    p, q = ratio
    return (index + 1) * p // q > index * p // q


def vocab_size(groups: Sequence[GroupSpec]) -> int:
    """The vocabulary: the first dim of the largest 2-D tensor named `embed` (0 if none).

    Example:
        >>> vocab_size([GroupSpec.from_shapes("embed", {"tok_embed.weight": (32000, 64)})])
        32000
    """
    return max((_vocab_of(g) for g in groups), default=0)


@functools.lru_cache(maxsize=65536)  # a model's groups, asked at every split
def _vocab_of(group: GroupSpec) -> int:
    sizes = [
        e.shape[0]
        for e in group.entries
        if "embed" in e.name and e.shape is not None and len(e.shape) == 2
    ]
    return max(sizes, default=0)


@functools.lru_cache(maxsize=256)  # advise asks at every split: the same groups
def _per_token(
    groups: tuple[GroupSpec, ...], share: float, ratio: tuple[int, int] | None
) -> tuple[float, int, float]:
    """Elements per token at the peak: kept, block inputs, the largest block recomputed.

    (What the kernels keep, the block inputs kept whole under checkpointing, and the largest
    block's activations, alive again while its backward recomputes it.)
    """
    kept = [_kept_per_token(g, share) for g in groups]
    if ratio is None:  # no checkpointing
        return sum(kept), 0, 0.0
    blocks: dict[int, float] = {}  # block index -> its activations per token
    inputs: dict[int, int] = {}  # block index -> its input width
    rest = 0.0
    for group, per_token in zip(groups, kept, strict=True):
        index = block_index(group.name)
        if index is None or not is_checkpointed(index, ratio):
            rest += per_token
            continue
        blocks[index] = blocks.get(index, 0.0) + per_token
        inputs[index] = max(inputs.get(index, 0), _input_width(group))
    # A block's input is one tensor whatever its kernels (not scaled).
    return rest, sum(inputs.values()), max(blocks.values(), default=0.0)


def _kept_per_token(group: GroupSpec, share: float) -> float:
    # Kept by layout (names without indices, shapes): repeated layers count once.
    key = (group.layout_id, share)
    known = _KEPT.get(key)
    if known is None:
        known = _KEPT[key] = _count_kept(group, share)
    return known


_KEPT: dict[tuple[int, float], float] = {}


def _count_kept(group: GroupSpec, share: float) -> float:
    rest, per_expert, fused, _ = classify(group)
    kept = float(sum(_kept(e.name, e.shape, e.numel) for e in rest))
    routed = sum(_kept(e.name, e.shape, e.numel) for es in per_expert.values() for e in es)
    # A fused expert tensor (E, out, in) is E matmuls.
    routed += sum(
        e.shape[0] * _kept(e.name, e.shape[1:], e.numel // e.shape[0]) if e.shape else 0
        for e in fused
    )
    return kept + share * routed


def _kept(name: str, shape: tuple[int, ...] | None, numel: int) -> int:
    if shape is None:  # a group file without shapes: a flat tensor, as a 1-D one
        return 0
    if "embed" in name:
        return shape[-1] if len(shape) == 2 else 0
    if len(shape) == 1:
        return shape[0]
    if len(shape) == 2:
        return shape[0] + shape[1]
    return 0  # convolutions and the like: not modelled


@functools.lru_cache(maxsize=4096)
def _input_width(group: GroupSpec) -> int:
    widths = [e.shape[0] for e in group.entries if e.shape is not None and len(e.shape) == 1]
    if widths:
        return max(widths)
    matrices = [e.shape for e in group.entries if e.shape is not None and len(e.shape) == 2]
    return matrices[0][1] if matrices else 0
