"""The two FP8 formats and exact round-to-nearest-even onto their grids.

Rounding is done in float32 arithmetic (scale by a power of two, add and subtract 1.5 * 2**23)
so that a value is already on the FP8 grid before any cast: the cast itself is then exact on
the CPU, on the GPU and in Triton's interpreter (whose own float32 -> float8 cast is not RNE).
"""

from __future__ import annotations

import enum
import math

import torch


class FP8Format(str, enum.Enum):
    """FP8 storage format of a compressed tensor."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @classmethod
    def parse(cls, value: FP8Format | str | torch.dtype) -> FP8Format:
        if isinstance(value, FP8Format):
            return value
        if isinstance(value, str) and value.lower() in _BY_NAME:  # the hot path: once per parameter per step
            return _BY_NAME[value.lower()]
        if value == torch.float8_e4m3fn:
            return cls.E4M3
        if value == torch.float8_e5m2:
            return cls.E5M2
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown FP8 format {value!r}: use 'e4m3' (torch.float8_e4m3fn) or 'e5m2' "
                "(torch.float8_e5m2)"
            ) from None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FP8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        """Largest finite magnitude (448 for E4M3, 57344 for E5M2)."""
        return float(torch.finfo(self.dtype).max)

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is FP8Format.E4M3 else 2

    @property
    def min_normal_exponent(self) -> int:
        """log2 of the smallest normal magnitude (-6 for E4M3, -14 for E5M2)."""
        return int(math.log2(torch.finfo(self.dtype).smallest_normal))

    @property
    def expansion_range(self) -> float:
        """Rf of COAT's dynamic range expansion: FP8_MAX**2 / 2."""
        return self.max * self.max / 2.0


_BY_NAME = {f.value: f for f in FP8Format}
_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: adding then subtracting it rounds |t| < 2**22 to an integer


def round_to_fp8_grid(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Round float32 `y` to the nearest FP8 value (ties to even), saturating at +-FP8_MAX.

    Mirrors kernels' `_round_to_fp8`: the result is exactly representable, so `.to(fmt.dtype)`
    is an exact cast.
    """
    y = y.float().clamp(-fmt.max, fmt.max)
    bits = y.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent.clamp(min=fmt.min_normal_exponent)
    # 2**(mantissa_bits - exponent): the spacing of the grid is its reciprocal
    inv_ulp = ((fmt.mantissa_bits - exponent + 127) << 23).view(torch.float32)
    ulp = ((exponent - fmt.mantissa_bits + 127) << 23).view(torch.float32)
    magnitude = ((y.abs() * inv_ulp + _RNE_MAGIC) - _RNE_MAGIC) * ulp
    return torch.copysign(magnitude, y)  # keeps -0.0, as torch's own cast does
