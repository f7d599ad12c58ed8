"""The two FP8 formats and exact round-to-nearest-even onto their grids.

torch's float32 -> float8 cast rounds to nearest even; it does not saturate (out-of-range values
become NaN for E4M3), so values are clamped first. Checked for every float32 bit pattern, both
formats, against a float32 bit-arithmetic rounding (tests/formats/exhaustive_fp8_cast.py: 0 mismatches).
The Triton kernels round with that bit arithmetic under the interpreter, whose own cast is not
RNE (kernels/fp8_triton.py), and with the GPU's cvt.rn.satfinite otherwise.
"""

from __future__ import annotations

import enum
import math

import torch


class FP8Format(str, enum.Enum):
    """FP8 storage format of a compressed tensor: E4M3 (torch.float8_e4m3fn) or E5M2 (float8_e5m2).

    A str enum, so "e4m3" and FP8Format.E4M3 compare equal; options that take a format accept the
    enum, its string or the torch dtype.

    Args:
        value (`str`): "e4m3" or "e5m2" (`FP8Format.parse` also takes any case or a torch dtype).

    Returns:
        `FP8Format`, with `dtype`, `max` (448 or 57344), `mantissa_bits` and `min_normal_exponent`.

    Raises:
        ValueError: an unknown format (`FP8Format.parse` names the two there are).

    Example:
        >>> fmt = FP8Format.parse("E5M2")
        >>> fmt.dtype, fmt.max
        (torch.float8_e5m2, 57344.0)
    """

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

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The floating-point dtypes every codec takes (and parameters may have)."""


def round_to_fp8_grid(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Round float32 `y` to the nearest FP8 value (ties to even), saturating at +-FP8_MAX; NaN
    stays NaN and -0.0 stays -0.0. The result is exactly representable, so `.to(fmt.dtype)` is an
    exact cast (the same bits as rounding with float32 bit arithmetic, in one pass)."""
    return y.float().clamp(-fmt.max, fmt.max).to(fmt.dtype).float()
