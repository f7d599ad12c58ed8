"""Master weights held as a 16-bit weight plus a correction: the pure-torch codec (and oracle).

The model keeps bfloat16 weights (what forward uses); the optimizer keeps what is needed to
stand for the float32 master x. All three modes work on float32 bit patterns with integer
arithmetic, so the Triton step (kernels/adamw_fused.py) computes the same bits:

- 32 bits: w = x rounded to bfloat16 (to nearest, ties away from zero: w = (bits + 2**15) >> 16)
  and the int16 remainder d = bits - (w << 16), which that rounding keeps within int16's range;
  w and d give back x exactly: bits = (w << 16) + d.
- 24 bits: w = x rounded to nearest bfloat16 (ties to even) and an int8 correction
  c = round((x - w) / s), with s = ulp(w) / 256 a power of two: x ~= w + c * s, within s / 2,
  or within s where x lies within s / 2 of half a bfloat16 step above w (c = +128 is clamped
  to 127; about 1 value in 512): a relative error of at most 2**-15.
- 16 bits: no correction; x is rounded to bfloat16 stochastically, rounding up with probability
  equal to the dropped fraction: unbiased. The random bits are a hash of (seed, step, element),
  so a run is reproducible and its resume bit-exact.
"""

from __future__ import annotations

import torch

from .rounding_hash import hash32

MASTER_BITS = (16, 24, 32)
"""The master-weight modes (None: the parameter is its own master)."""
CORRECTION_DTYPES = {32: torch.int16, 24: torch.int8}
"""Storage of the correction per mode (16 keeps none)."""
# s = ulp(w) / 256 as a float32 exponent field: bfloat16 keeps 7 fraction bits, the correction 8
_CORRECTION_EXPONENT_OFFSET = 7 + 8
# below this bfloat16 exponent field, s stays at its value there (a floor of 2**-126 absolute)
_MIN_CORRECTION_EXPONENT = 1 + _CORRECTION_EXPONENT_OFFSET
_MASK32 = 0xFFFFFFFF


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns as int64 in [0, 2**32)."""
    return x.float().contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (taken mod 2**32) as float32."""
    b = bits & _MASK32
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _bf16(high: torch.Tensor) -> torch.Tensor:
    """The bfloat16 whose bit pattern is `high` (int64, taken mod 2**16)."""
    h = high & 0xFFFF
    return torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(torch.bfloat16)


def _bf16_bits(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def split32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x -> (bfloat16 weight, int16 remainder) with join32 giving back x exactly."""
    bits = _bits(x)
    high = (bits + 2**15) >> 16  # to nearest bfloat16, ties away from zero (on the magnitude)
    rem = bits - (high << 16)  # in [-2**15, 2**15): fits int16 (mod 2**32 where bits wrapped)
    rem = (rem + 2**31) % 2**32 - 2**31
    w = torch.where(torch.isnan(x), x.to(torch.bfloat16), _bf16(high))  # (a NaN stays a NaN)
    return w, rem.to(torch.int16)


def join32(w: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The float32 master of a 32-bit split: bits = (w << 16) + remainder."""
    x = _from_bits((_bf16_bits(w) << 16) + rem.to(torch.int64))
    return torch.where(torch.isnan(w), w.float(), x)


def correction_scale(w: torch.Tensor) -> torch.Tensor:
    """s = ulp(w) / 256 as float32 (a power of two), from w's exponent field."""
    field = (_bf16_bits(w) >> 7) & 0xFF
    field = field.clamp(min=_MIN_CORRECTION_EXPONENT)
    return ((field - _CORRECTION_EXPONENT_OFFSET) << 23).to(torch.int32).view(torch.float32)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> nearest bfloat16 (ties to even) in integer arithmetic: the kernel's rounding."""
    bits = _bits(x)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = torch.isnan(x)
    return torch.where(nan, x.to(torch.bfloat16), _bf16(high))


def split24(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x -> (bfloat16 weight, int8 correction) with join24(w, c) within s of x."""
    x = x.float()
    w = round_to_bf16(x)
    s = correction_scale(w)
    c = torch.round((x - w.float()) / s).clamp(-128, 127)  # the difference and the division are exact
    c = torch.where(torch.isfinite(c), c, 0.0)
    return w, c.to(torch.int8)


def join24(w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The float32 master of a 24-bit split: w + c * s."""
    return w.float() + c.float() * correction_scale(w)


def random_bits(seed: int, step: int, offsets: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64) per element offset, for master_bits=16's rounding."""
    return hash32(seed, step, offsets) & 0xFFFF


def stochastic_round_bf16(x: torch.Tensor, seed: int, step: int, first_element: int = 0) -> torch.Tensor:
    """float32 x -> bfloat16, rounding the magnitude up with probability (dropped bits) / 2**16;
    x's elements are elements first_element, first_element + 1, ... of their tensor."""
    offsets = torch.arange(first_element, first_element + x.numel(), device=x.device).reshape(x.shape)
    bits = _bits(x) + random_bits(seed, step, offsets)
    out = _bf16(bits >> 16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)
