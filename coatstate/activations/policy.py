"""What compress_activations and CompiledActivations do with each saved tensor, by op kind."""

from __future__ import annotations

import dataclasses
import enum

import torch.nn.functional as F

from coatstate.activations.op_kinds import OpKind
from coatstate.formats.fp8 import FP8Format


class Granularity(str, enum.Enum):
    """How a saved tensor is held until backward."""

    KEEP = "keep"
    """Uncompressed (the tensor itself)."""
    TENSOR = "tensor"
    """FP8 with one scale for the whole tensor (COAT's choice for linear inputs)."""
    GROUP = "group"
    """FP8 with one scale per group of `group_size` along the last dim (COAT's non-linear)."""
    BF16 = "bf16"
    """A float32 tensor held as bfloat16 (half the bytes, 8 significant bits); bfloat16 and
    float16 tensors are kept as they are."""


# Activation functions whose output is f(saved input): autograd node name -> (f, its kwargs read
# off the node's non-tensor attributes, which reading does not unpack).
RECOMPUTABLE = {
    "GeluBackward0": lambda n: (F.gelu, {"approximate": n._saved_approximate}),
    "SiluBackward0": lambda n: (F.silu, {}),
    "MishBackward0": lambda n: (F.mish, {}),
    "HardswishBackward0": lambda n: (F.hardswish, {}),
    "HardsigmoidBackward0": lambda n: (F.hardsigmoid, {}),
    "LeakyReluBackward0": lambda n: (F.leaky_relu, {"negative_slope": n._saved_negative_slope}),
    "SoftplusBackward0": lambda n: (F.softplus, {"beta": n._saved_beta, "threshold": n._saved_threshold}),
}


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """What compress_activations and CompiledActivations do with each saved tensor, by op kind.

    A frozen dataclass; each field's own docstring (in policy.py) says why its default is what it
    is. Strings are accepted for the enums ("keep", "tensor", "group", "bf16"; "e4m3", "e5m2").

    Args:
        linear, norm, activation, attention, attention_v_out, loss, other (`Granularity`): how
            the tensors saved by each op kind are held (`Granularity.KEEP` keeps them as they are).
        compiled, compiled_fp32 (`Granularity`): 16-bit and float32 tensors saved by a
            torch.compile'd graph under compress_activations (the op is not visible at run time).
        fmt (`FP8Format`): FP8 format of the codes.
        group_size (`int`): elements per scale group for `Granularity.GROUP`, a power of two <= 1024.
        min_numel (`int`): tensors with fewer elements are kept.
        backend (`str`): "auto" (Triton on CUDA, pure torch elsewhere), "torch" or "triton".
        recompute (`bool`): recompute activation-function outputs in backward from their held input.

    Returns:
        `ActivationPolicy`, for compress_activations(policy) or CompiledActivations(policy); both
        also take its fields as keyword arguments.

    Raises:
        ValueError: a value that is not a granularity, an unknown format, a bad group size,
            min_numel, recompute or backend.

    Example:
        >>> policy = ActivationPolicy(attention="keep", min_numel=0)
        >>> with coatstate.compress_activations(policy, fmt="e5m2"):
        ...     loss = model(x).loss
    """

    linear: Granularity = Granularity.TENSOR
    """Inputs of linear/matmul/conv: per-tensor scaled, as COAT (FP8-GEMM ready). With power-of-two
    scales, per tensor and per group ("group") differ only for values far below the tensor's
    maximum; docs/benchmarks.md compares the two in training."""
    norm: Granularity = Granularity.BF16
    """Inputs of LayerNorm/RMSNorm/...: bfloat16, not COAT's per-group FP8 ("group"). A norm's
    backward feeds every gradient below it and its weight gradient is a sum that cancels, so FP8
    there cost measurable accuracy (docs/FORMAT.md); under bf16 autocast the residual stream a
    norm reads is float32, so bfloat16 still halves it."""
    activation: Granularity = Granularity.GROUP
    """Inputs/outputs saved by GELU/SiLU/softmax/...: per-group, as COAT."""
    attention: Granularity = Granularity.KEEP
    """q and k saved by scaled_dot_product_attention: kept by default, not COAT's per-group FP8
    ("group"). Attention's backward recomputes the softmax from the held q and k but subtracts the
    forward's exact logsumexp, so FP8 q and k give rows that no longer sum to one, and gradients
    that come out systematically small; the shrink grows as the logits grow in training
    (benchmarks/experiments/activation_grad_error.py; the GPU parity runs with "group" are in
    docs/accuracy.md). Where q, k and v are views of one qkv projection they share one storage
    region, held with q's granularity."""
    attention_v_out: Granularity = Granularity.KEEP
    """v and the output saved by attention: kept by default. Backward forms dP - rowsum(dO * O)
    from them, a difference that cancels, and compressing them pushed gradient cosines below the
    test bound. Where q, k and v are views of one qkv projection (GPT-2 style) they share one
    storage region, packed once with q's granularity (the first save decides)."""
    loss: Granularity = Granularity.KEEP
    """Log-probabilities saved by cross_entropy: kept, FP8 log-probs would distort exp() badly."""
    other: Granularity = Granularity.GROUP
    """Everything else (elementwise products of SwiGLU and RoPE, ...)."""
    compiled: Granularity = Granularity.GROUP
    """16-bit tensors that a torch.compile'd graph saves (entered outside the compiled call): the
    op that made them is not visible at run time, so one granularity serves them all (matmul and
    attention inputs, activation-function inputs)."""
    compiled_fp32: Granularity = Granularity.KEEP
    """float32 tensors a compiled graph saves: kept by default. Under autocast these are the
    residual stream that norms read, norm statistics and attention's logsumexp, which cannot be
    told apart at run time; the logsumexp does not survive even bfloat16 (backward takes exp of
    scores minus it). Without autocast everything is float32: choose "bf16" or "group" there."""
    fmt: FP8Format = FP8Format.E4M3
    """FP8 format of the codes."""
    group_size: int = 16
    """Elements per group along the last dim for GROUP (a power of two; 16 as COAT)."""
    min_numel: int = 2**16
    """Tensors with fewer elements are kept: below that, launches cost more than the bytes saved."""
    backend: str = "auto"
    """'auto' (Triton kernels on CUDA, pure torch elsewhere), 'torch' or 'triton'."""
    recompute: bool = True
    """Outputs of activation functions (GELU, SiLU, ...) whose input the same call saved compressed
    are not stored again when a later op saves them: backward recomputes them from that input."""

    def __post_init__(self) -> None:
        for name in [k.value for k in OpKind] + ["attention_v_out", "compiled", "compiled_fp32"]:
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
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be True or False; got {self.recompute!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton'; got {self.backend!r}")

    def granularity(self, kind: OpKind) -> Granularity:
        return getattr(self, kind.value)

    @classmethod
    def resolve(cls, policy: ActivationPolicy | None, overrides: dict) -> ActivationPolicy:
        """`policy` (default: ActivationPolicy()) with keyword overrides, checked by name."""
        policy = policy if policy is not None else cls()
        if not isinstance(policy, cls):
            raise TypeError(f"policy must be an ActivationPolicy; got {type(policy).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; ActivationPolicy fields are {sorted(fields)}")
        return dataclasses.replace(policy, **overrides)


KEEP_ALL = {
    f.name: Granularity.KEEP
    for f in dataclasses.fields(ActivationPolicy)
    if isinstance(getattr(ActivationPolicy(), f.name), Granularity)
}
"""Overrides for a policy that compresses nothing, `compress_activations(**KEEP_ALL)`: the
uncompressed baseline, counted by the same ActivationStats."""
