"""The shapes the planner plans with, from config keys, plain numbers or a parameter count (no
transformers needed), and the model each one builds: coatstate.models' GPT (GPT-2 configs) or
Llama (Llama configs; also Mistral/Qwen2-style configs with the same keys, grouped-query
attention included).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

from coatstate.models import MODELS, ModelConfig
from coatstate.planner.units import check_range


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the planner's own models need to know."""

    arch: str
    """'gpt' or 'llama'."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    """MLP width."""
    vocab: int
    max_seq: int
    """Positions (GPT-2's learned table; rotary tables for Llama)."""
    tied: bool
    """Head shares the embedding matrix."""
    loss_chunks: int = 1
    """Head + loss over this many checkpointed chunks of tokens (1: full logits)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq", "loss_chunks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int; got {getattr(self, name)!r}")
        for name, flag in (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"),
                           ("kv_heads", "kv_heads"), ("ffn", "ffn"), ("vocab", "vocab"),
                           ("max_seq", "seq"), ("loss_chunks", "loss_chunks")):  # fmt: skip
            check_range(flag, getattr(self, name), name)
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"arch must be 'gpt' or 'llama'; got {self.arch!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden={self.hidden} must divide by heads={self.heads}, and heads by "
                f"kv_heads={self.kv_heads}"
            )

    def layer_params(self) -> int:
        d, f, kv = self.hidden, self.ffn, self.hidden // self.heads * self.kv_heads
        if self.arch == "gpt":
            return 3 * d * d + 3 * d + d * d + d + 2 * d * f + f + d + 4 * d
        return d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d

    def total_params(self) -> int:
        d = self.hidden
        embed = self.vocab * d * (1 if self.tied else 2)
        extra = self.max_seq * d + 2 * d if self.arch == "gpt" else d
        return embed + extra + self.layers * self.layer_params()


def default_ffn(arch: str, hidden: int) -> int:
    """GPT-2: 4x. Llama: 2/3 of 4x, rounded up to a multiple of 256 (7B: 4096 -> 11008)."""
    return 4 * hidden if arch == "gpt" else 256 * math.ceil(8 * hidden / 3 / 256)


KNOWN_SHAPES = {  # arch: (name, layers, hidden, heads, kv_heads, ffn, vocab) of published models
    "llama": [
        ("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256),
        ("Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256),
        ("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000),
        ("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000),
        ("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000),
    ],
    "gpt": [
        ("GPT-2", 12, 768, 12, 12, 3072, 50257),
        ("GPT-2-medium", 24, 1024, 16, 16, 4096, 50257),
        ("GPT-2-large", 36, 1280, 20, 20, 5120, 50257),
        ("GPT-2-xl", 48, 1600, 25, 25, 6400, 50257),
    ],
}
"""The shapes `--params` alone picks from: the published model nearest in parameter count."""


def shape_for_params(arch: str, params: int, max_seq: int = 2048, loss_chunks: int = 1) -> tuple[Shape, str]:
    """(the Shape, its name) of the published `arch` model nearest to `params` (on a log scale),
    for `coatstate plan --params 7B` without --layers and --hidden."""
    candidates = []
    for name, layers, hidden, heads, kv, ffn, vocab in KNOWN_SHAPES[arch]:
        shape = Shape(arch, layers, hidden, heads, kv, ffn, vocab, max_seq, arch == "gpt", loss_chunks)
        candidates.append((abs(math.log(shape.total_params() / params)), name, shape))
    _, name, shape = min(candidates, key=lambda c: c[0])
    return shape, name


def shape_from_numbers(
    *,
    arch: str,
    layers: int,
    hidden: int,
    params: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    max_seq: int = 2048,
    loss_chunks: int = 1,
) -> Shape:
    """A Shape from plain numbers; with `params` and no `vocab`, the vocabulary absorbs the rest."""
    heads = heads or max(1, hidden // 128)
    ffn = ffn or default_ffn(arch, hidden)
    tied = arch == "gpt"
    base = dict(
        arch=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads or heads,
        ffn=ffn,
        max_seq=max_seq,
        tied=tied,
        loss_chunks=loss_chunks,
    )
    if vocab is None:
        if params is None:
            vocab = 32000
        else:
            rest = params - Shape(vocab=1, **base).total_params() + hidden * (1 if tied else 2)
            vocab = rest // (hidden * (1 if tied else 2))
            if vocab < 1:
                raise ValueError(
                    f"--params {params:,} is fewer than {layers} {arch} layers of width {hidden} already "
                    "hold: raise --params or lower --layers/--hidden"
                )
    return Shape(vocab=vocab, **base)


CONFIG_RANGES = {  # config key: the flag whose range it gets
    "n_layer": "layers", "num_hidden_layers": "layers",
    "n_embd": "hidden", "hidden_size": "hidden",
    "n_head": "heads", "num_attention_heads": "heads", "num_key_value_heads": "kv_heads",
    "n_inner": "ffn", "intermediate_size": "ffn",
    "vocab_size": "vocab",
    "n_positions": "seq", "n_ctx": "seq", "max_position_embeddings": "seq",
}  # fmt: skip


def check_config(cfg: dict[str, Any]) -> None:
    """A config's numbers get the flags' types and ranges before anything is built: n_layer 1e8
    would otherwise build for minutes, a float or a string fail deep inside torch."""
    for key, flag in CONFIG_RANGES.items():
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"config {key} must be an integer; got {type(v).__name__} {v!r:.40}")
        check_range(flag, v, f"config {key}")


def shape_from_config(cfg: dict[str, Any], *, loss_chunks: int = 1) -> Shape:
    """A Shape from a transformers-style config dict (GPT-2 or Llama keys)."""
    check_config(cfg)
    get = lambda *keys, default=None: next((cfg[k] for k in keys if cfg.get(k) is not None), default)  # noqa: E731
    if "n_embd" in cfg or cfg.get("model_type") == "gpt2":
        d = get("n_embd", "hidden_size")
        missing = [
            k for k, v in (("n_embd", d), ("n_layer", get("n_layer")), ("n_head", get("n_head"))) if v is None
        ]
        if missing:
            raise ValueError(f"GPT-2 config lacks {missing}")
        return Shape(
            "gpt",
            get("n_layer"),
            d,
            get("n_head"),
            get("n_head"),
            get("n_inner", default=4 * d),
            get("vocab_size", default=50257),
            get("n_positions", "n_ctx", default=1024),
            True,
            loss_chunks,
        )
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if cfg.get(k) is None]
    if missing:
        raise ValueError(
            f"config has neither GPT-2 keys (n_embd, n_layer, n_head) nor Llama keys: missing {missing}; "
            "pass module:factory for other architectures"
        )
    heads = cfg["num_attention_heads"]
    return Shape(
        "llama",
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        heads,
        get("num_key_value_heads", default=heads),
        cfg["intermediate_size"],
        cfg["vocab_size"],
        get("max_position_embeddings", default=2048),
        bool(cfg.get("tie_word_embeddings", False)),
        loss_chunks,
    )


def build_model(s: Shape) -> nn.Module:
    """The coatstate.models GPT or Llama of a Shape: forward(idx, targets) -> mean cross-entropy."""
    cfg = ModelConfig(
        vocab=s.vocab,
        layers=s.layers,
        dim=s.hidden,
        heads=s.heads,
        seq=s.max_seq,
        loss_chunks=s.loss_chunks,
        hidden=s.ffn,
        kv_heads=s.kv_heads,
        tied=s.tied,
    )
    return MODELS[s.arch](cfg)
