"""GPT and Llama: the two reference language models. The planner builds them from a config or a
parameter count; the tests, examples and benchmarks train them.

- GPT: GPT-2 style (LayerNorm, GELU-tanh MLP, causal SDPA attention, learned or rotary positions).
- Llama: Llama style (RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention).

Both take token ids (B, S) and targets and return the mean cross-entropy. With `loss_chunks > 1`
the head and the loss run over chunks of tokens under non-reentrant checkpointing, so the
(tokens x vocab) logits never exist all at once.

    >>> model = Llama(ModelConfig(vocab=32000, layers=2, dim=256, heads=4))
    >>> loss = model(idx, targets)
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
    """The shape of a GPT or a Llama, and the few ways the two are written."""

    vocab: int = 50304
    """Vocabulary size (GPT-2's 50257 padded to a multiple of 64)."""
    layers: int = 24
    dim: int = 1024
    heads: int = 16
    seq: int = 1024
    """Longest sequence: GPT's learned positions, Llama's rotary tables."""
    loss_chunks: int = 1
    """Chunks of tokens for the head + loss (1: one full logits tensor)."""
    hidden: int | None = None
    """MLP width; None: 4 * dim (GPT), 8/3 * dim rounded up to a multiple of 64 (Llama)."""
    kv_heads: int | None = None
    """Key and value heads (grouped-query attention); None: `heads` (set so on construction)."""
    tied: bool | None = None
    """The head shares the embedding matrix; None: GPT ties it, Llama does not."""
    positions: str = "learned"
    """GPT: "learned" (GPT-2's table) or "rope" (rotary, computed in float32 in every layer)."""
    gpt2_init: bool = False
    """GPT: GPT-2's init, both residual output projections scaled by 1/sqrt(2 layers) and biases
    zero; False scales attention's output projection only and keeps torch's bias init."""
    layout: str = "fused"
    """Llama: "fused" (q/k/v and gate/up each one GEMM, F.rms_norm with eps 1e-5 and the rotary
    tables in the compute dtype, residual output projections scaled at init) or "eager" (separate
    projections, an RMSNorm written out in float32 with eps 1e-6, rotary in float32, every matrix
    N(0, 0.02): as many ports write it, and what op-kind detection has to recognize)."""
    cast_residual: bool = False
    """Llama: under autocast, the residual stream in the compute dtype (as throughput-minded
    training code keeps it); False keeps it float32, as transformers' Llama does."""

    def __post_init__(self) -> None:
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"positions must be 'learned' or 'rope'; got {self.positions!r}")
        if self.layout not in ("fused", "eager"):
            raise ValueError(f"layout must be 'fused' or 'eager'; got {self.layout!r}")
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"dim={self.dim} must divide by heads={self.heads}, and heads by kv_heads={self.kv_heads}"
            )

    @classmethod
    def byte_level(cls, layers: int, dim: int, seq: int) -> ModelConfig:
        """The byte-level GPT of the standard-library training runs: 256 tokens, 64-wide heads."""
        return cls(vocab=256, layers=layers, dim=dim, heads=max(1, dim // 64), seq=seq)


def chunked_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean cross-entropy of head(h) against targets, over `chunks` checkpointed chunks of tokens."""
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


# ------------------------------------------------------------------------------------------ GPT
def rotate(x: torch.Tensor) -> torch.Tensor:
    """GPT's rotary positions on (batch, heads, seq, head_dim), computed in float32 in place of a
    table (the parity harness's recorded runs were made so)."""
    s, half = x.shape[-2], x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(s, device=x.device, dtype=torch.float32).view(s, 1) * freq
    cos, sin, xf = angle.cos(), angle.sin(), x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.rope = cfg.heads, cfg.positions == "rope"
        self.kv_dim = cfg.dim // cfg.heads * cfg.kv_heads
        self.qkv = nn.Linear(cfg.dim, cfg.dim + 2 * self.kv_dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        gqa = self.kv_dim != d
        q, k, v = self.qkv(x).split([d, self.kv_dim, self.kv_dim] if gqa else d, dim=2)
        q, k, v = (t.view(b, s, -1, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.rope:
            q, k = rotate(q), rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.proj(y.transpose(1, 2).contiguous().view(b, s, d))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden or 4 * cfg.dim
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, cfg.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 style language model: forward(idx, targets) -> mean cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied is not False:
            self.head.weight = self.wte.weight
        scaled = {id(b.attn.proj.weight) for b in self.blocks}
        if cfg.gpt2_init:
            scaled |= {id(b.mlp[2].weight) for b in self.blocks}
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers) if id(p) in scaled else 0.02)
            elif cfg.gpt2_init and name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return chunked_loss(self.head, self.ln_f(x), targets, self.cfg.loss_chunks)


# ---------------------------------------------------------------------------------------- Llama
class RMSNorm(nn.Module):
    """Written out in float32 (pow, mean, rsqrt, mul), as many Llama ports do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FusedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight is cast to the input's dtype, so torch's fused kernel runs under
    autocast (it refuses a bf16 input with an fp32 weight and falls back to a composite)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def rope_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.fused = cfg.heads, cfg.layout == "fused"
        self.kv_dim = cfg.dim // cfg.heads * cfg.kv_heads
        if self.fused:
            self.qkv = nn.Linear(cfg.dim, cfg.dim + 2 * self.kv_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wk = nn.Linear(cfg.dim, self.kv_dim, bias=False)
            self.wv = nn.Linear(cfg.dim, self.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd, gqa = d // self.heads, self.kv_dim != d
        if not self.fused:
            q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            cos, sin = cos[:s], sin[:s]  # (float32: q and k rotate in float32)
        else:
            if gqa:
                q, k, v = self.qkv(x).split([d, self.kv_dim, self.kv_dim], dim=2)
                q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
            else:
                q, k, v = self.qkv(x).view(b, s, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            cos, sin = cos[:s].to(q.dtype), sin[:s].to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        y = y.transpose(1, 2)
        return self.wo(y.reshape(b, s, d) if self.fused else y.contiguous().view(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden or 64 * ((8 * cfg.dim // 3 + 63) // 64)
        self.fused = cfg.layout == "fused"
        if self.fused:
            self.w13 = nn.Linear(cfg.dim, 2 * hidden, bias=False)
        else:
            self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
            self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def _norm(cfg: ModelConfig) -> nn.Module:
    return FusedRMSNorm(cfg.dim, eps=1e-5) if cfg.layout == "fused" else RMSNorm(cfg.dim)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = _norm(cfg)
        self.attn = LlamaAttention(cfg)
        self.norm2 = _norm(cfg)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """Llama style language model: forward(idx, targets) -> mean cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.seq, cfg.dim // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        residual = {id(m.weight) for b in self.blocks for m in (b.attn.wo, b.mlp.w2)}
        for p in self.parameters():
            if p.dim() == 2:
                scale = cfg.layout == "fused" and id(p) in residual
                nn.init.normal_(p, std=0.02 / (2 * cfg.layers) ** 0.5 if scale else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if self.cfg.cast_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return chunked_loss(self.head, self.norm(x), targets, self.cfg.loss_chunks)


MODELS = {"gpt": GPT, "llama": Llama}
"""The architectures by name (the planner's `arch`, the benchmarks' --arch)."""
