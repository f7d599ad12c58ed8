"""Small reference models shared by tests, benchmarks and examples.

- GPT: GPT-2 style (learned positions, LayerNorm, GELU MLP, causal SDPA attention, tied head).
- Llama: Llama style (hand-written RMSNorm, SwiGLU MLP, rotary embeddings, SDPA, untied head).

Both take token ids (B, S) and targets and return the mean cross-entropy loss. `loss_chunks > 1`
computes the head and the loss over chunks of tokens under non-reentrant checkpointing, so the
(tokens x vocab) logits never exist all at once (what memory-conscious training code does).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 50304
    """Vocabulary size (GPT-2's 50257 padded to a multiple of 64)."""
    layers: int = 24
    dim: int = 1024
    heads: int = 16
    seq: int = 1024
    """Maximum sequence length."""
    loss_chunks: int = 1
    """Chunks of tokens for the head + loss (1: one full logits tensor)."""

    @classmethod
    def from_args(cls, args) -> ModelConfig:
        """The config that add_shape_args' options describe."""
        return cls(
            vocab=args.vocab,
            layers=args.layers,
            dim=args.dim,
            heads=args.heads,
            seq=args.seq,
            loss_chunks=args.loss_chunks,
        )

    @classmethod
    def byte_level(cls, layers: int, dim: int, seq: int) -> ModelConfig:
        """The byte-level GPT of the standard-library training runs: 256 tokens, 64-wide heads."""
        return cls(vocab=256, layers=layers, dim=dim, heads=max(1, dim // 64), seq=seq)


def add_shape_args(p, *, dim: int = 1024, batch_help: str = "sequences per step") -> None:
    """The GPU benchmarks' model-shape options (GPT-2-medium by default) and batch size."""
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help=batch_help)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--loss-chunks", type=int, default=8)


def chunked_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    h = h.reshape(-1, h.shape[-1])
    targets = targets.reshape(-1)
    if chunks <= 1:
        return F.cross_entropy(head(h).float(), targets)

    def piece(hc, tc):
        return F.cross_entropy(head(hc).float(), tc, reduction="sum")

    total = sum(
        checkpoint(piece, hc, tc, use_reentrant=False)
        for hc, tc in zip(h.chunk(chunks), targets.chunk(chunks), strict=False)
    )
    return total / targets.numel()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, s, d))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 style language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return chunked_loss(self.head, self.ln_f(x), targets, self.cfg.loss_chunks)


class RMSNorm(nn.Module):
    """Written out by hand (pow, mean, rsqrt, mul), as many Llama ports do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        hd = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(cfg.seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            w(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        cos, sin = self.cos[:s], self.sin[:s]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim)
        self.attn = LlamaAttention(cfg)
        self.norm2 = RMSNorm(cfg.dim)
        hidden = 64 * ((8 * cfg.dim // 3 + 63) // 64)
        self.mlp = SwiGLU(cfg.dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """Llama style language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return chunked_loss(self.head, self.norm(x), targets, self.cfg.loss_chunks)


MODELS = {"gpt": GPT, "llama": Llama}
