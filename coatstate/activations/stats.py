"""What a compress_activations context (or a CompiledActivations graph) held, packed and kept."""

from __future__ import annotations

import collections
import dataclasses
import enum


class KeepReason(str, enum.Enum):
    """Why a saved tensor was held uncompressed: the keys of ActivationStats.kept_reasons.
    (Reasons that carry a number or an op kind are built by `small` and `by_policy`.)"""

    __str__ = str.__str__
    __format__ = str.__format__

    LEAF = "parameter or other leaf requiring grad"
    BEFORE_CONTEXT = "created before the context"
    PARAMETER_CAST = "parameter cast or view"
    GRAPH_INPUT = "input of a compiled graph"
    NOT_FLOAT = "not float16/bfloat16/float32"
    NO_GRAD_FN = "no grad_fn (buffers, frozen parameters, statistics such as mean, rstd, logsumexp)"
    GRAPH_OUTPUT = "also returned by the compiled graph"
    ATTENTION_STATISTICS = "attention statistics"
    LAYOUT_NOT_RECOGNISED = "graph layout not recognised (warned)"

    @staticmethod
    def small(min_numel: int) -> str:
        return f"smaller than min_numel={min_numel}"

    @staticmethod
    def by_policy(label: str) -> str:
        return f"policy keeps {label}"


KEPT_NOT_ACTIVATION = frozenset(
    {KeepReason.LEAF, KeepReason.BEFORE_CONTEXT, KeepReason.PARAMETER_CAST, KeepReason.GRAPH_INPUT}
)
"""Reasons for keeping a tensor that stays alive anyway: they are not activation memory."""

_KIND_KEYS: dict = {}  # (label, granularity) -> "label/granularity", a key of packed_by_kind


@dataclasses.dataclass
class ActivationStats:
    """What a compress_activations context (or a CompiledActivations) did: counts and bytes.

    Read it as `ctx.stats`; counts are taken when tensors are saved (at compile time for
    CompiledActivations), so a context entered every step reports that step.

    Attributes:
        packed, kept, shared, recomputed (`int`): saved tensors compressed, held as they are,
            answered by an earlier save of the same memory, and recomputed in backward.
        bytes_original, bytes_packed, bytes_recomputed (`int`): bytes of the compressed tensors
            before and after, and of the recomputed ones (which hold none).
        kept_reasons, bytes_kept (`collections.Counter`): kept tensors and their bytes, by reason.
        packed_by_kind (`collections.Counter`): compressed tensors by "kind/granularity".
        activation_bytes_original, activation_bytes_held (`int`): saved activation bytes without
            and with compression (parameters and inputs held anyway left out); `ratio` divides them.

    Returns:
        `summary()` returns these as a few lines of text.

    Example:
        >>> with coatstate.compress_activations() as ctx:
        ...     loss = model(x).loss
        >>> ctx.stats.ratio, ctx.stats.kept_reasons
        >>> print(ctx.stats.summary())
    """

    packed: int = 0
    """Tensors compressed."""
    shared: int = 0
    """Saves answered by an earlier save of the same memory (compressed or kept once)."""
    kept: int = 0
    """Tensors held uncompressed (see kept_reasons)."""
    recomputed: int = 0
    """Activation-function outputs recomputed in backward from their held input instead of held."""
    bytes_original: int = 0
    """Bytes the compressed regions had."""
    bytes_packed: int = 0
    """Bytes they take packed (codes and scale bytes)."""
    bytes_recomputed: int = 0
    """Bytes the recomputed outputs had (they hold none)."""
    bytes_kept: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Bytes kept, by reason."""
    kept_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Count of kept tensors, by reason."""
    packed_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Count of compressed tensors, by 'kind/granularity'."""

    def add_logged(self, kept: list[tuple], packed: list[tuple]) -> None:
        """Count saves logged as reason, bytes (two items) per kept tensor and (label, granularity,
        bytes, packed bytes) per compressed one: compress_activations logs each save with appends (a
        fraction of what the counter updates cost per save) and counts them when its stats are read."""
        kept_reasons, bytes_kept = self.kept_reasons, self.bytes_kept
        for reason, nbytes in zip(kept[::2], kept[1::2], strict=True):
            kept_reasons[reason] += 1
            bytes_kept[reason] += nbytes
        self.kept += len(kept) // 2
        for label, granularity, nbytes, packed_bytes in packed:
            key = _KIND_KEYS.get((label, granularity))
            if key is None:
                key = _KIND_KEYS[(label, granularity)] = f"{label}/{granularity.value}"
            self.packed_by_kind[key] += 1
            self.bytes_original += nbytes
            self.bytes_packed += packed_bytes
        self.packed += len(packed)

    @property
    def bytes_kept_activations(self) -> int:
        """Kept bytes that are activations (not parameters, buffers, inputs held anyway)."""
        return sum(v for k, v in self.bytes_kept.items() if k not in KEPT_NOT_ACTIVATION)

    @property
    def activation_bytes_original(self) -> int:
        return self.bytes_original + self.bytes_recomputed + self.bytes_kept_activations

    @property
    def activation_bytes_held(self) -> int:
        return self.bytes_packed + self.bytes_kept_activations

    @property
    def ratio(self) -> float:
        """Saved activation bytes without compression / with it (>= 1; 1.0 when nothing saved)."""
        held = self.activation_bytes_held
        return self.activation_bytes_original / held if held else 1.0

    def summary(self) -> str:
        mib = 2.0**20
        lines = [
            f"compressed {self.packed} tensors: {self.bytes_original / mib:.2f} MiB -> "
            f"{self.bytes_packed / mib:.2f} MiB; {self.shared} saves shared an earlier one; "
            f"{self.recomputed} outputs ({self.bytes_recomputed / mib:.2f} MiB) recomputed in backward",
            f"saved activations {self.activation_bytes_original / mib:.2f} MiB -> "
            f"{self.activation_bytes_held / mib:.2f} MiB held ({self.ratio:.2f}x smaller)",
        ]
        for reason, count in sorted(self.kept_reasons.items()):
            lines.append(f"kept {count} ({self.bytes_kept[reason] / mib:.2f} MiB): {reason}")
        return "\n".join(lines)
