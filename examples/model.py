"""A small Llama-style decoder (RMSNorm, rotary attention, SwiGLU or routed MoE experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


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
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends over (batch, seq, dim)."""
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.num_heads, d // self.num_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    """The gated MLP of Llama."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the MLP."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A router and separate expert modules (as many MoE codebases have them)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.dim, max(1, cfg.hidden // 4)) for _ in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sends each token to its top-k experts and sums their weighted outputs."""
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


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
        return x + self.mlp(self.mlp_norm(x))


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of (batch, seq) token ids."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in fp32 at least."""
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, tokens[:, 1:].reshape(-1))
