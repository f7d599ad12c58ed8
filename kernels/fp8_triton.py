"""Triton device functions shared by the kernels: FP8 rounding and the group codec math.

Each mirrors a function of coatstate.formats operation for operation (same float32 ops in the
same order), so plain quantization is bit-exact against the torch twin on the GPU and in
Triton's interpreter. With expansion, log2/exp2 are the GPU's approximations (lg2/ex2.approx.ftz, so float32
subnormal magnitudes, below 2**-126, count as zero there) and 16/k is an approximate division:
codes may then differ from the twin by one FP8 step, the dequantized values stay within the
format's error bound (formats.error_bound).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..formats import group as _group
from ..formats.fp8 import FLOAT_DTYPES, FP8Format

# module constants must be constexpr to be read inside @triton.jit functions
EXPONENT_DENOMINATOR = tl.constexpr(_group.EXPONENT_DENOMINATOR)
MIN_EXPONENT_CODE = tl.constexpr(_group.MIN_EXPONENT_CODE)
MAX_EXPONENT_CODE = tl.constexpr(_group.MAX_EXPONENT_CODE)
MIN_SCALE = tl.constexpr(_group.MIN_SCALE)
FLOAT32_MAX = tl.constexpr(_group.FLOAT32_MAX)
# On the GPU, log2 is the hardware's lg2.approx (tl.log2 would be libdevice's exact, branchy
# log2f: 4x the instructions); the interpreter has no libdevice, so it uses numpy's log2.
FAST_MATH = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def log2(x):
    if FAST_MATH:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def fast_divide(a, b):
    """a / b within 2 ulp for |b| < 2**126: on the GPU rcp.approx and a multiply (div.full adds
    range checks, ~8 instructions per element here); the interpreter divides exactly."""
    if FAST_MATH:
        return libdevice.fast_dividef(a, b)
    else:
        return tl.math.fdiv(a, b)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host (triton.cdiv is a constexpr function: microseconds per call)."""
    return -(-a // b)


def check_float_input(name: str, x: torch.Tensor) -> None:
    """Host-side check shared by the launchers: a contiguous float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16; got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {x.stride()}")


class GroupFormat(NamedTuple):
    """A moment's code format as one `tl.constexpr` argument (group_format builds it): Triton
    specializes a kernel on its fields. Pass it whole or read its fields; nested in another
    tuple it does not compile on Triton 3.6."""

    EXPAND: bool
    """per-group exponent codes (range expansion)"""
    MAX: float
    """the FP8 format's largest finite value"""
    MBITS: int
    """its mantissa bits"""
    EMIN: int
    """its smallest normal exponent"""
    LOG2_MAX: float
    """log2(MAX)"""
    K_NUMERATOR: float
    """EXPONENT_DENOMINATOR * log2 of its expansion range"""
    IS_E4M3: bool
    """E4M3 codes (else E5M2)"""
    FP4: int = 0
    """a 4-bit moment's format (fp4_triton's E2M1 or UE3M1_SQRT), which leaves the FP8 fields
    unused; 0 for FP8 codes"""


def group_format(fmt: FP8Format, expand: bool, fp4: int = 0) -> GroupFormat:
    """The constexpr describing codes in `fmt` (with expansion if `expand`) for the functions below."""
    return GroupFormat(
        EXPAND=expand,
        MAX=fmt.max,
        MBITS=fmt.mantissa_bits,
        EMIN=fmt.min_normal_exponent,
        LOG2_MAX=math.log2(fmt.max),
        K_NUMERATOR=EXPONENT_DENOMINATOR * math.log2(fmt.expansion_range),
        IS_E4M3=fmt is FP8Format.E4M3,
        FP4=fp4,
    )


@triton.jit
def group_offsets(gid, n_groups, cols, groups_per_row, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """Element offsets [len(gid), GROUP] and mask of groups `gid` of a (rows, cols) tensor viewed
    as rows of groups. EVEN (every row is whole groups): groups are consecutive GROUP-element runs,
    which the compiler can load with 16-byte vectors."""
    gmask = gid < n_groups
    if EVEN:
        offs = gid[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        offs = tl.max_contiguous(tl.multiple_of(offs, [GROUP, GROUP]), [1, GROUP])
        return offs, gmask[:, None]
    else:
        row = gid // groups_per_row
        col0 = (gid - row * groups_per_row) * GROUP
        cols_in_row = col0[:, None] + tl.arange(0, GROUP)[None, :]
        return row[:, None] * cols + cols_in_row, gmask[:, None] & (cols_in_row < cols)


@triton.jit
def store_per_group(ptrs, x, gmask, LANES: tl.constexpr = 16):
    """Store per-group values `x` (a [groups] tile: one value a row of the element tile) at `ptrs`.
    Stored as a [groups, LANES] tile, lane 0 of each row writing: its layout (one value a thread,
    LANES threads a row) is then the element tile's own for 16-byte bfloat16 rows of 128 (LANES
    threads a row), where each thread already holds its row's value. A plain [groups] store
    takes Triton's 1-D layout instead, and reaching it from the rows costs a shared-memory round
    trip and two barriers a store."""
    lane = tl.arange(0, LANES)[None, :]
    first = gmask[:, None] & (lane == 0)
    tl.store(ptrs[:, None] + lane, tl.broadcast_to(x[:, None], (x.shape[0], LANES)), mask=first)


@triton.jit
def copysign(mag, sign_of):
    """|mag| with the sign bit of `sign_of` (as torch.copysign: -0.0 stays -0.0)."""
    bits = (mag.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | (sign_of.to(tl.int32, bitcast=True) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp8_grid(y, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE onto the FP8 grid in float32, saturating; keeps the sign of zero (formats.round_to_fp8_grid)."""
    y = tl.minimum(
        tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL
    )
    mag = tl.abs(y)
    e = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    inv_ulp = ((MBITS - e + 127) << 23).to(tl.float32, bitcast=True)
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    r = ((mag * inv_ulp + 12582912.0) - 12582912.0) * ulp
    return copysign(r, y)


@triton.jit
def to_fp8_bits(y, FMT: tl.constexpr):
    """float32 -> FP8 code as uint8. On the GPU the conversion instruction itself rounds to
    nearest even and saturates (cvt.rn.satfinite: NaN stays NaN, +-Inf -> +-max), which is
    exactly formats.round_to_fp8_grid and saves ~16 integer ops per element; the interpreter's
    conversion truncates instead (checked against torch's cast), so there the grid is rounded first."""
    if FAST_MATH:
        r = y
    else:
        r = round_to_fp8_grid(y, FMT.MAX, FMT.MBITS, FMT.EMIN)
    if FMT.IS_E4M3:
        bits = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = r.to(tl.float8e5).to(tl.uint8, bitcast=True)
    if not FAST_MATH:  # the interpreter's cast loses NaN; 0x7F is a NaN in both formats
        bits = tl.where(r != r, 0x7F, bits).to(tl.uint8)
    return bits


@triton.jit
def from_fp8_bits(b, IS_E4M3: tl.constexpr):
    """FP8 code stored as uint8 -> float32."""
    if IS_E4M3:
        q = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        q = b.to(tl.float8e5, bitcast=True).to(tl.float32)
    if not FAST_MATH:  # the interpreter's cast reads the all-ones exponent as a number
        low = b & 0x7F
        if IS_E4M3:
            q = tl.where(low == 0x7F, float("nan"), q)
        else:
            q = tl.where(low > 0x7C, float("nan"), tl.where(low == 0x7C, q * float("inf"), q))
    return q


@triton.jit
def smallest_positive(mag):
    """Per group (row) of a [groups, G] tile of magnitudes: the smallest one above zero. On the
    GPU as unsigned integers: bits - 1 wraps zero to the top, so one integer add replaces a compare
    and a select per element. An all-zero group gives +inf in the interpreter and 0 on the GPU;
    group_params selects on max > 0, so either is unused."""
    if FAST_MATH:
        shifted = mag.to(tl.uint32, bitcast=True) - 1
        return (tl.min(shifted, axis=1) + 1).to(tl.float32, bitcast=True)
    else:
        return tl.min(tl.where(mag > 0, mag, float("inf")), axis=1)


@triton.jit
def group_params(mag, FMT: tl.constexpr):
    """Per-group (scale a, exponent code 16k, k, 1/a) of a [groups, G] tile of magnitudes."""
    mx = tl.max(mag, axis=1)
    if FMT.EXPAND:
        mn = smallest_positive(mag)
        log_mx = log2(mx)
        log_range = log_mx - log2(mn)
        # approximate division: k is stored, so a kernel/twin difference in k only picks another
        # valid exponent for the group
        k16 = tl.math.floor(tl.math.fdiv(tl.full(log_range.shape, FMT.K_NUMERATOR, tl.float32), log_range))
        k16 = tl.minimum(tl.maximum(k16, MIN_EXPONENT_CODE), MAX_EXPONENT_CODE)
        k16 = tl.where(mx > 0, k16, EXPONENT_DENOMINATOR)
        inv_k = tl.math.fdiv(tl.full(k16.shape, EXPONENT_DENOMINATOR, tl.float32), k16)
        a = tl.exp2(log_mx - FMT.LOG2_MAX * inv_k)
        a = tl.where(mx > 0, tl.maximum(a, MIN_SCALE), 0.0)
        k = k16 * (1.0 / EXPONENT_DENOMINATOR)  # exact: a power of two
        # log2(a) of an all-zero group is 0, not -inf: encode's log2(0) - log2(a) is then -inf
        # (code 0) rather than NaN, with no per-element select
        return a, k16, k, tl.where(mx > 0, log2(a), 0.0)
    else:
        a = tl.math.div_rn(mx, tl.full(mx.shape, FMT.MAX, tl.float32))
        a = tl.minimum(a, FLOAT32_MAX / FMT.MAX * (1 - 2.0**-20))  # as the twin: MAX * a stays finite
        a = tl.where(mx > 0, tl.maximum(a, MIN_SCALE), 0.0)
        inv = tl.where(a > 0, tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), a), 0.0)
        return a, a, inv, a


@triton.jit
def encode(x, mag, p0, p1, EXPAND: tl.constexpr):
    """Codes (float32, before rounding) of a [groups, G] tile; p0/p1 from group_params: (k, log2 a)
    with expansion, (1/a, unused) without."""
    if EXPAND:
        if FAST_MATH:  # one fma per element (k * log2 a is per group); on the GPU ex2(k * lg2(0)) is 0
            y = tl.exp2(p0[:, None] * log2(mag) - (p0 * p1)[:, None])
        else:  # the twin's order; numpy's log2(0) warns, hence the select
            y = tl.where(mag > 0, tl.exp2(p0[:, None] * (log2(mag) - p1[:, None])), 0.0)
        return copysign(y, x)
    else:
        return x * p0[:, None]


@triton.jit
def decode(bits, scale, k16, FMT: tl.constexpr):
    """float32 values of a [groups, G] tile of FP8 codes (uint8 bits) with per-group scale (and 16k)."""
    q = from_fp8_bits(bits, FMT.IS_E4M3)
    if FMT.EXPAND:
        inv_k = tl.math.fdiv(tl.full(k16.shape, EXPONENT_DENOMINATOR, tl.float32), k16)
        x = tl.exp2(log2(tl.abs(q)) * inv_k[:, None] + log2(scale)[:, None])
        x = tl.minimum(x, FLOAT32_MAX, propagate_nan=tl.PropagateNan.ALL)  # a NaN code stays NaN
        if FAST_MATH:  # a compare and a select (copysign costs 4 instructions here); a zero code
            # is already 0 here (a -0 code decodes to +0: the same value)
            return tl.where(q < 0, -x, x)
        else:
            return copysign(tl.where(q != 0, x, 0.0), q)
    else:
        return q * scale[:, None]


@triton.jit
def encode_store(x, codes_ptrs, scale_ptrs, exp_ptrs, mask, gmask, FMT: tl.constexpr):
    """Quantize a [groups, G] float32 tile into the group format and store its codes (uint8),
    per-group scales and, with expansion, exponent codes (the codec and the fused step)."""
    # NaN/Inf elements: out of the group's scale, stored as the NaN code (as formats.group)
    finite = tl.abs(x) < float("inf")
    mag = tl.where(finite, tl.abs(x), 0.0)
    a, k16, p0, p1 = group_params(mag, FMT)
    y = tl.where(finite, encode(x, mag, p0, p1, FMT.EXPAND), float("nan"))
    tl.store(codes_ptrs, to_fp8_bits(y, FMT), mask=mask)
    store_per_group(scale_ptrs, a, gmask)
    if FMT.EXPAND:
        store_per_group(exp_ptrs, k16.to(tl.uint8), gmask)


@triton.jit
def load_decode(codes_ptrs, scale_ptrs, exp_ptrs, mask, gmask, FMT: tl.constexpr):
    """Load a [groups, G] tile in the group format (codes, per-group scales and, with expansion,
    exponent codes) and return its float32 values (the codec and the fused step)."""
    bits = tl.load(codes_ptrs, mask=mask, other=0)
    scale = tl.load(scale_ptrs, mask=gmask, other=0.0)
    if FMT.EXPAND:
        k16 = tl.load(exp_ptrs, mask=gmask, other=16).to(tl.float32)
    else:
        k16 = scale
    return decode(bits, scale, k16, FMT)
