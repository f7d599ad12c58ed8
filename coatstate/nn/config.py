"""FP8LinearConfig: how FP8Linear computes."""

from __future__ import annotations

import dataclasses

from coatstate.formats.fp8 import FP8Format

_BACKENDS = ("auto", "scaled_mm", "emulate")
_WEIGHT_GRADS = ("fp8", "high_precision")


@dataclasses.dataclass(frozen=True)
class FP8LinearConfig:
    """How FP8Linear computes: a frozen dataclass (each field's docstring, in config.py, says why).

    Args:
        backend (`str`): "auto" (torch._scaled_mm on CUDA with compute capability >= 8.9, else
            emulated in high precision), "scaled_mm" or "emulate".
        grad_fmt (`FP8Format` or `str`): FP8 format of the output gradient ("e5m2" by default).
        fast_accum (`bool`): use_fast_accum for the forward GEMM.
        weight_grad (`str`): "fp8" (dW as an FP8 GEMM) or "high_precision" (dW from the unquantized
            gradient and the decoded FP8 input).

    Returns:
        `FP8LinearConfig`, for FP8Linear(config=...) and convert_to_fp8(model, config=...).

    Raises:
        ValueError: an unknown backend, weight_grad or format.
        TypeError: `fast_accum` is not a bool.

    Example:
        >>> config = coatstate.FP8LinearConfig(weight_grad="high_precision")
        >>> coatstate.convert_to_fp8(model, config=config)
    """

    backend: str = "auto"
    """'auto' (scaled_mm on CUDA with compute capability >= 8.9, else emulate), 'scaled_mm', 'emulate'."""
    grad_fmt: FP8Format = FP8Format.E5M2
    """FP8 format of the output gradient. E4M3 has one more mantissa bit but 2**15 less range,
    and range is what training needs (docs/benchmarks.md compares both): E5M2, as in torchao and
    TransformerEngine."""
    fast_accum: bool = True
    """use_fast_accum for the forward GEMM (the backward GEMMs always accumulate exactly in fp32)."""
    weight_grad: str = "fp8"
    """'fp8': dW = g_q^T @ x_q in FP8 (COAT's, the fastest). 'high_precision': dW = g^T @ x' in the
    output gradient's dtype, g unquantized and x' the saved FP8 input decoded (as torchao's
    rowwise_with_gw_hp recipe): dW then keeps only x's E4M3 error, for fewer tokens/s."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}; got {self.backend!r}")
        if self.weight_grad not in _WEIGHT_GRADS:
            raise ValueError(f"weight_grad must be one of {_WEIGHT_GRADS}; got {self.weight_grad!r}")
        object.__setattr__(self, "grad_fmt", FP8Format.parse(self.grad_fmt))
        if not isinstance(self.fast_accum, bool):
            raise TypeError(f"fast_accum must be a bool; got {self.fast_accum!r}")
