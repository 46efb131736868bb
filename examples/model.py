"""A small Llama-style decoder (RMSNorm, rotary attention, SwiGLU or routed MoE experts)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Config:
    """Sizes of the decoder; `num_experts` > 0 replaces each SwiGLU MLP by a routed MoE."""

    vocab: int = 37
    dim: int = 20
    num_heads: int = 2
    num_layers: int = 2
    hidden: int = 27
    num_experts: int = 0  # 0: dense SwiGLU MLP; else a routed MoE of this many experts
    top_k: int = 2
    tie_embeddings: bool = False
    fused_experts: bool = False  # one [num_experts, ...] parameter per projection


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned scale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes the last dim."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (..., seq, head_dim)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    half = head_dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * freqs[None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half :]], dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.dim // cfg.num_heads
        # Rows head by head (each head's q, k, v together): a column-parallel split of wqkv
        # over tensor-parallel ranks then gives each rank whole heads.
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends over (batch, seq, dim)."""
        b, s, _ = x.shape
        qkv = self.wqkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # this rank's, under tensor parallelism
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))
        return projected


class SwiGLU(nn.Module):
    """The gated MLP of Llama."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the MLP."""
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


def _dispatch(
    experts: list[Callable[[torch.Tensor], torch.Tensor]],
    first: int,
    flat: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Runs expert `first + i` on the tokens routed to it; sums the weighted outputs."""
    out = torch.zeros_like(flat)
    for index, expert in enumerate(experts, start=first):
        token, slot = (chosen == index).nonzero(as_tuple=True)
        if token.numel():
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
    return out


class ExpertList(nn.ModuleList):
    """Separate SwiGLU experts, as many MoE codebases hold them; called with the routing.

    `first_expert`: the index of the first one (expert parallelism holds a share of them).
    """

    first_expert = 0

    def forward(
        self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's chosen experts (those held here)."""
        return _dispatch(list(self), self.first_expert, flat, chosen, weights)


class GroupedExperts(nn.Module):
    """Every expert's SwiGLU in one [num_experts, ...] parameter per projection.

    How Hugging Face transformers 5 and torchtitan hold MoE experts: three parameters per
    block whatever the number of experts.
    """

    first_expert = 0  # as in ExpertList

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def __len__(self) -> int:
        return self.w1.shape[0]

    def split(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """One function per expert held here, over views of the fused weights.

        One `unbind` per projection: its backward stacks the experts' gradients in one op
        (indexing each expert apart would add a full-size gradient per expert).
        """
        # Under expert parallelism the weights are Shard(0) DTensors: this rank's experts.
        local = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)]
        w1, w3, w2 = (w.unbind(0) for w in local)
        return [functools.partial(_swiglu, *weights) for weights in zip(w1, w3, w2, strict=True)]

    def forward(
        self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's chosen experts (those held here)."""
        return _dispatch(self.split(), self.first_expert, flat, chosen, weights)


def _swiglu(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class MoE(nn.Module):
    """A router and its experts: separate modules (as many MoE codebases have them) or fused."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        hidden = max(1, cfg.hidden // 4)
        self.experts: ExpertList | GroupedExperts = (
            GroupedExperts(cfg.dim, hidden, cfg.num_experts)
            if cfg.fused_experts
            else ExpertList(SwiGLU(cfg.dim, hidden) for _ in range(cfg.num_experts))
        )
        # Benchmarks set this to (tokens, top_k) expert indices: the routing then does not
        # depend on the weights' values (a fake process group gathers no real weights).
        self.forced_choice: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sends each token to its top-k experts and sums their weighted outputs."""
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        if self.forced_choice is None:
            weights, chosen = probs.topk(self.top_k, dim=-1)
        else:
            chosen = self.forced_choice
            weights = probs.gather(1, chosen)
        mixed: torch.Tensor = self.experts(flat, chosen, weights)
        return mixed.view_as(x)


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp: nn.Module = MoE(cfg) if cfg.num_experts else SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention then MLP, each with a residual."""
        x = x + self.attn(self.attn_norm(x))
        mlp_out: torch.Tensor = self.mlp(self.mlp_norm(x))
        return x + mlp_out


class Decoder(nn.Module):
    """Embedding, blocks, final norm and an output head (tied to the embedding if asked)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    @property
    def blocks(self) -> list[Block]:
        """The blocks of `layers`, typed as such (a ModuleList yields plain modules)."""
        return [cast(Block, layer) for layer in self.layers]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of (batch, seq) token ids."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in fp32 at least."""
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, tokens[:, 1:].reshape(-1))
