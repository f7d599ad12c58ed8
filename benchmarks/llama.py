"""A Llama-style language model for the FP8 training benchmark (benchmarks/fp8_linear_train.py).

Unlike models.Llama (hand-written fp32 RMSNorm, separate q/k/v and w1/w3), this one is shaped the
way throughput-minded training code writes it, so that the GEMMs are most of the step: fused QKV
and gate/up projections, F.rms_norm (weight cast to the compute dtype), rotary embeddings in the
compute dtype, SDPA (flash), and a residual stream in the compute dtype (under autocast with fp32
master weights). All linear
layers are nn.Linear without bias, every dim a multiple of 16 (torch._scaled_mm's constraint).
The head and loss run over chunks of tokens (models.chunked_loss) so the logits never exist all
at once.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from models import chunked_loss
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 18
    heads: int = 16
    hidden: int = 5632
    """SwiGLU width (TinyLlama's 5632 for dim 2048)."""
    seq: int = 2048
    loss_chunks: int = 8

    @property
    def params(self) -> int:
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.hidden + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim


def rope_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight is cast to the input's dtype, so torch's fused kernel runs under
    autocast (it refuses a bf16 input with an fp32 weight and falls back to a composite)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = cos[:s].to(q.dtype), sin[:s].to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim, eps=1e-5)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.dim, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """Token ids (B, S) and targets -> mean cross-entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, eps=1e-5)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.dim // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * cfg.layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if torch.is_autocast_enabled(x.device.type):  # residual stream in the compute dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return chunked_loss(self.head, self.norm(x), targets, self.cfg.loss_chunks)
