"""log2 and exp2 in float32 from IEEE basic operations: the same bits on every CPU and code path.

The expanded FP8 codec is defined by these two functions (docs/FORMAT.md, "Bits"). Each is a
fixed sequence of float32 additions, multiplications, one division and exact bit manipulations,
every one rounded once to nearest even, so the result depends only on the input: not on the
vector width (ATEN_CPU_CAPABILITY), the thread split or where a value falls in a tensor.
torch's eager kernels run each operation below as its own pass (nothing can fuse a multiply and
an add into an FMA), and kernels/cpu_step.cpp spells out the same sequence in C++ built with
contraction off. Accuracy against float64 math (tests/formats/test_portable_math.py): log2 within 3 ulp
(1.25 where |log2 x| >= 1), exp2 within 1.25 ulp; an FP8 code's step is 2**20 ulp.
"""

from __future__ import annotations

import functools

import torch

LOG2_COEFFICIENTS = tuple(
    float.fromhex(h)
    for h in ("0x1.715476p+1", "0x1.ec709ep-1", "0x1.2776c6p-1", "0x1.a61762p-2", "0x1.484b14p-2")
)
"""float32(2 / (ln2 (2n + 1))), n = 0..4: log2(m) = s * sum(c_n s^2n) with s = (m - 1) / (m + 1);
for m in [sqrt(1/2), sqrt(2)), |s| < 0.172 and the next term is below 2**-26."""
EXP2_COEFFICIENTS = tuple(
    float.fromhex(h)
    for h in (
        "0x1p+0", "0x1.62e430p-1", "0x1.ebfbe0p-3", "0x1.c6b08ep-5",
        "0x1.3b2ab6p-7", "0x1.5d87fep-10", "0x1.430912p-13", "0x1.ffcbfcp-17",
    )
)  # fmt: skip
"""float32((ln 2)**n / n!), n = 0..7: 2**f for |f| <= 1/2 (the next term is below 2**-28)."""
SQRT2 = float.fromhex("0x1.6a09e6p+0")
"""float32(sqrt(2)): mantissas at or above it are halved, so |s| stays small."""
_ROUNDING_SHIFTER = 12582912.0  # 1.5 * 2**23: (y + it) - it rounds y to an integer, ties to even
_SMALLEST_NORMAL = 2.0**-126


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def log2_mantissa(m: torch.Tensor) -> torch.Tensor:
    """log2 of float32 mantissas in [sqrt(1/2), sqrt(2)): the part of log2 that m alone decides."""
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = _f32(LOG2_COEFFICIENTS[4], m).expand_as(s)
    for c in LOG2_COEFFICIENTS[3::-1]:
        p = p * s2 + c
    return s * p


def log2(x: torch.Tensor) -> torch.Tensor:
    """log2 of a non-negative float tensor as float32: -inf at 0, +inf at +inf, NaN at NaN.
    Subnormal inputs are scaled by 2**23 first (exactly); negative inputs are not defined."""
    x = x.float()
    sub = x < _SMALLEST_NORMAL
    xs = torch.where(sub, x * 8388608.0, x)
    bits = xs.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(sub, 23, 0).to(torch.int32)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    high = m >= SQRT2
    m = torch.where(high, m * 0.5, m)
    e = e + high.to(torch.int32)
    r = log2_mantissa(m) + e.float()
    r = torch.where(x == 0, -torch.inf, r)
    return torch.where((x == torch.inf) | torch.isnan(x), x, r)


def exp2(y: torch.Tensor) -> torch.Tensor:
    """2**y of a float tensor as float32: 0 at -inf, +inf at +inf, NaN at NaN."""
    yc = y.float().clamp(-151.0, 129.0)
    n = (yc + _ROUNDING_SHIFTER) - _ROUNDING_SHIFTER
    f = yc - n  # exact: |f| <= 1/2
    p = _f32(EXP2_COEFFICIENTS[7], f).expand_as(f)
    for c in EXP2_COEFFICIENTS[6::-1]:
        p = p * f + c
    ni = torch.where(torch.isnan(n), 0.0, n).to(torch.int32)
    n1 = ni.clamp(-100, 127)  # p * 2**n1 stays a normal number; the second factor rounds once
    n2 = ni - n1
    return (p * ((n1 + 127) << 23).view(torch.float32)) * ((n2 + 127) << 23).view(torch.float32)


def log2_of_fp8(codes: torch.Tensor) -> torch.Tensor:
    """log2 |code| of FP8 codes as float32, from a 256-entry table of `log2` (-inf at zero, NaN at NaN)."""
    table = _fp8_log2_table(codes.dtype, codes.device)
    return table[codes.view(torch.uint8).long()]


@functools.cache
def _fp8_log2_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().abs()
    return log2(values).to(device)
