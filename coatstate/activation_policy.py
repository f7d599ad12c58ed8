"""Which saved activations compress_activations compresses, and how: the policy and its report.

An op kind is decided from the outermost torch function running when autograd saves a tensor
(recorded by a TorchFunctionMode), falling back to the innermost nn.Module's class for ops that
say nothing by themselves (the pow/mul/rsqrt of a hand-written RMSNorm count as NORM).
"""

from __future__ import annotations

import collections
import dataclasses
import enum

import torch

from coatstate.formats.fp8 import FP8Format


class Granularity(str, enum.Enum):
    """How a saved tensor is held until backward."""

    KEEP = "keep"
    """Uncompressed (the tensor itself)."""
    TENSOR = "tensor"
    """FP8 with one float32 scale for the whole tensor (COAT's choice for linear inputs)."""
    GROUP = "group"
    """FP8 with one float32 scale per group of `group_size` along the last dim (COAT's non-linear)."""


class OpKind(str, enum.Enum):
    """The kind of op that saved a tensor."""

    LINEAR = "linear"
    NORM = "norm"
    ACTIVATION = "activation"
    ATTENTION = "attention"
    LOSS = "loss"
    OTHER = "other"


_KIND_BY_NAME: dict[str, OpKind] = {}
for _kind, _names in {
    OpKind.LINEAR: "linear matmul __matmul__ __rmatmul__ mm bmm addmm baddbmm addbmm einsum mv addmv "
    "bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d",
    OpKind.NORM: "layer_norm rms_norm group_norm batch_norm instance_norm normalize local_response_norm",
    OpKind.ACTIVATION: "gelu silu relu relu6 sigmoid tanh softmax softmin mish elu selu celu leaky_relu "
    "hardswish hardsigmoid hardtanh softplus glu logsigmoid prelu",
    OpKind.ATTENTION: "scaled_dot_product_attention multi_head_attention_forward flex_attention",
    OpKind.LOSS: "cross_entropy log_softmax nll_loss binary_cross_entropy binary_cross_entropy_with_logits "
    "kl_div mse_loss l1_loss smooth_l1_loss huber_loss",
}.items():
    for _name in _names.split():
        _KIND_BY_NAME[_name] = _kind


def kind_of_function(func) -> OpKind:
    """The op kind of a torch function (by name: F.linear, torch.matmul, Tensor.__matmul__, ...)."""
    return _KIND_BY_NAME.get(getattr(func, "__name__", ""), OpKind.OTHER)


def kind_of_module(module: torch.nn.Module) -> OpKind:
    """Fallback kind from the module that runs the op (norm and activation-function modules)."""
    cls = type(module)
    if "norm" in cls.__name__.lower():
        return OpKind.NORM
    if cls.__module__ == "torch.nn.modules.activation" and not issubclass(cls, torch.nn.MultiheadAttention):
        return OpKind.ACTIVATION
    return OpKind.OTHER


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """What compress_activations does with each saved tensor. Strings are accepted for enums."""

    linear: Granularity = Granularity.TENSOR
    """Inputs of linear/matmul/conv: per-tensor scaled, as COAT (FP8-GEMM ready)."""
    norm: Granularity = Granularity.GROUP
    """Inputs of LayerNorm/RMSNorm/...: per-group, as COAT."""
    activation: Granularity = Granularity.GROUP
    """Inputs/outputs saved by GELU/SiLU/softmax/...: per-group, as COAT."""
    attention: Granularity = Granularity.GROUP
    """q and k saved by scaled_dot_product_attention (its logsumexp is always kept)."""
    attention_v_out: Granularity = Granularity.KEEP
    """v and the output saved by attention: kept by default. Backward forms dP - rowsum(dO * O)
    from them, a difference that cancels, and FP8 there cost the most gradient fidelity of any
    tensor we measured (tests/test_activations.py prints it)."""
    loss: Granularity = Granularity.KEEP
    """Log-probabilities saved by cross_entropy: kept, FP8 log-probs would distort exp() badly."""
    other: Granularity = Granularity.GROUP
    """Everything else (elementwise products of SwiGLU and RoPE, ops of compiled graphs)."""
    fmt: FP8Format = FP8Format.E4M3
    """FP8 format of the codes."""
    group_size: int = 16
    """Elements per group along the last dim for GROUP (a power of two; 16 as COAT)."""
    min_numel: int = 2**16
    """Tensors with fewer elements are kept: below that, launches cost more than the bytes saved."""
    backend: str = "auto"
    """'auto' (Triton kernels on CUDA, pure torch elsewhere), 'torch' or 'triton'."""

    def __post_init__(self) -> None:
        for name in [k.value for k in OpKind] + ["attention_v_out"]:
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, Granularity(value))
            except ValueError:
                raise ValueError(
                    f"{name}={value!r} is not a granularity: use 'keep', 'tensor' or 'group'"
                ) from None
        object.__setattr__(self, "fmt", FP8Format.parse(self.fmt))
        g = self.group_size
        if not isinstance(g, int) or g < 1 or g & (g - 1) or g > 1024:
            raise ValueError(f"group_size must be a power of two in [1, 1024]; got {g!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int; got {self.min_numel!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton'; got {self.backend!r}")

    def granularity(self, kind: OpKind) -> Granularity:
        return getattr(self, kind.value)


KEPT_NOT_ACTIVATION = ("parameter or buffer", "module input", "leaf requiring grad", "parameter cast or view")
"""Reasons for keeping a tensor that stays alive anyway: they are not activation memory."""


@dataclasses.dataclass
class ActivationStats:
    """What a compress_activations context did (counts and bytes at pack time)."""

    packed: int = 0
    """Tensors compressed."""
    shared: int = 0
    """Saves answered by an earlier save of the same memory (compressed or kept once)."""
    kept: int = 0
    """Tensors held uncompressed (see kept_reasons)."""
    bytes_original: int = 0
    """Bytes the compressed tensors had."""
    bytes_packed: int = 0
    """Bytes they take packed (codes and scales)."""
    bytes_kept: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Bytes kept, by reason."""
    kept_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Count of kept tensors, by reason."""
    packed_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Count of compressed tensors, by 'kind/granularity'."""

    @property
    def bytes_kept_activations(self) -> int:
        """Kept bytes that are activations (not parameters, buffers, inputs held anyway)."""
        return sum(v for k, v in self.bytes_kept.items() if k not in KEPT_NOT_ACTIVATION)

    @property
    def activation_bytes_original(self) -> int:
        return self.bytes_original + self.bytes_kept_activations

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
            f"{self.bytes_packed / mib:.2f} MiB; {self.shared} saves shared an earlier one",
            f"saved activations {self.activation_bytes_original / mib:.2f} MiB -> "
            f"{self.activation_bytes_held / mib:.2f} MiB held ({self.ratio:.2f}x smaller)",
        ]
        for reason, count in sorted(self.kept_reasons.items()):
            lines.append(f"kept {count} ({self.bytes_kept[reason] / mib:.2f} MiB): {reason}")
        return "\n".join(lines)
