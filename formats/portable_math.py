"""log2 and exp2 whose float32 results depend only on their inputs, on every CPU.

torch's CPU log2/exp2 run vectorized approximations in a loop's body and the C library in its
scalar tail; the two can differ in the last bit of a float32 result, so the codec's bits would
depend on where a value falls in a tensor, on the thread split and on the machine's vector width
(ATEN_CPU_CAPABILITY). Here both are taken in float64 (every code path within a couple of ulps)
and rounded once to float32. That rounding is the same in every code path unless the float64
result lies within AMBIGUITY_ULPS of a float32 rounding boundary (about two values in a
million); those few are recomputed from IEEE basic operations alone (frexp, +, *, /), which every
code path rounds identically and which are accurate to far better than that margin, so the
choice of branch never changes a bit either.
"""

from __future__ import annotations

import functools
import math

import torch

AMBIGUITY_ULPS = 512
"""float64 ulps around a float32 rounding boundary (relative 2**-43 to 2**-44) inside which the
exact-arithmetic path decides: more than torch's float64 error (a couple of ulps) plus the exact
path's (some 2**-48 relative)."""
_DROPPED_BITS = 29  # float64 keeps 52 mantissa bits, float32 23
_HALF = 1 << (_DROPPED_BITS - 1)
_SMALLEST_NORMAL = 2.0**-126  # below it float32 rounds at a fixed spacing: decided exactly

_LN2 = math.log(2.0)
# log(m) = 2 * atanh(s), s = (m - 1) / (m + 1): with m in [sqrt(1/2), sqrt(2)), |s| < 0.172, so
# ten odd terms of the series leave a truncation error below 2**-55
_ATANH_TERMS = 10
# exp(t) for |t| <= ln(2) / 2: the Taylor series to t**14 / 14! leaves less than 2**-55
_EXP_TERMS = 14
# float32 results of exp2 underflow to zero below 2**-150 and overflow above 2**128
_EXP2_INPUT_LIMIT = 200.0


def log2(x: torch.Tensor) -> torch.Tensor:
    """log2 of a float tensor as float32: -inf at 0, NaN below 0 or at NaN, +inf at +inf."""
    xd = x.double()
    return _settle(torch.log2(xd), xd, _exact_log2)


def log2_of_fp8(codes: torch.Tensor) -> torch.Tensor:
    """log2 |code| of FP8 codes as float32, from a 256-entry table (-inf at zero, NaN at NaN)."""
    table = _fp8_log2_table(codes.dtype, codes.device)
    return table[codes.view(torch.uint8).long()]


@functools.lru_cache(maxsize=None)
def _fp8_log2_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double().abs()
    logs = [math.log2(v) if v > 0 else (-math.inf if v == 0 else math.nan) for v in values.tolist()]
    return torch.tensor(logs, dtype=torch.float64).float().to(device)


def exp2(y: torch.Tensor) -> torch.Tensor:
    """2**y of a float tensor as float32: 0 at -inf, +inf at +inf, NaN at NaN."""
    yd = y.double()
    return _settle(torch.exp2(yd), yd, _exact_exp2)


def _settle(approx: torch.Tensor, arg: torch.Tensor, exact) -> torch.Tensor:
    """Round float64 `approx` to float32, recomputing with `exact` where the rounding is close.

    Infinities, zeros and the canonical NaN have no low mantissa bits, so they are never close;
    anything else that reaches `exact` (a NaN payload, an underflow) comes out the same there."""
    dropped = approx.view(torch.int64) & ((1 << _DROPPED_BITS) - 1)
    close = dropped.sub_(_HALF).abs_() <= AMBIGUITY_ULPS
    if exact is _exact_exp2:
        close |= approx < _SMALLEST_NORMAL  # float32's fixed spacing there (log2 never lands there)
    rounded = approx.float()
    if bool(close.any()):
        where = close.nonzero(as_tuple=True)
        rounded[where] = exact(arg[where]).float()
    return rounded


def _exact_log2(xd: torch.Tensor) -> torch.Tensor:
    """float64 log2 of positive finite float64 values from basic operations only."""
    mant, expo = torch.frexp(xd)  # mant in [0.5, 1), exact
    small = mant < math.sqrt(0.5)
    mant = torch.where(small, mant * 2.0, mant)  # exact: a power-of-two scaling
    expo = expo.double() - small.double()
    s = (mant - 1.0) / (mant + 1.0)
    s2 = s * s
    poly = torch.full_like(s, 1.0 / (2 * _ATANH_TERMS - 1))
    for n in range(_ATANH_TERMS - 2, -1, -1):
        poly = poly * s2 + 1.0 / (2 * n + 1)
    return (s * poly) * (2.0 / _LN2) + expo


def _exact_exp2(yd: torch.Tensor) -> torch.Tensor:
    """float64 2**y of finite float64 values from basic operations only."""
    clamped = yd.clamp(-_EXP2_INPUT_LIMIT, _EXP2_INPUT_LIMIT)
    whole = torch.round(clamped)
    t = (clamped - whole) * _LN2  # the subtraction is exact; |t| <= ln(2) / 2
    poly = torch.full_like(t, 1.0 / math.factorial(_EXP_TERMS))
    for n in range(_EXP_TERMS - 1, -1, -1):
        poly = poly * t + 1.0 / math.factorial(n)
    # 2**whole as a float64 bit pattern: exact, where pow() would be one more approximation
    power = ((whole.to(torch.int64) + 1023) << 52).view(torch.float64)
    return poly * power
