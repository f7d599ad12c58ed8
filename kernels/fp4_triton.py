"""Triton device functions of the 4-bit moment formats (formats/fp4_moment.py, the twin).

A [groups, G] tile of a moment is stored as [groups, G/2] bytes (element 2j in the low nibble)
plus one float32 scale per group. Every operation mirrors the twin's float32 arithmetic in its
order: decode = level * (scale / top) with one correctly rounded division a group (then squared
for ue3m1_sqrt); encode = the nearest level of |u| * (top / scale), ties to the even code, found by
rounding in float32 bit arithmetic, which lands exactly where the twin's midpoint search does (no
float rounding, so the kernel and the twin agree bit for bit wherever their inputs do). The code
tile (int32 words where rows are whole groups, else bytes) is loaded and stored whole, each
thread's elements staying in its registers: no per-element byte gathers and no shuffles through
shared memory. FMT: 1 = e2m1, 2 = ue3m1_sqrt.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats.fp4_moment import MIN_SCALE as _MIN_SCALE
from ..formats.fp4_moment import FP4Format
from ..formats.fp8 import FP8Format
from ..formats.optimizer_state import MomentFormat
from .fp8_triton import FAST_MATH, GroupFormat, group_format, store_per_group

E2M1, UE3M1_SQRT = 1, 2
"""the FMT constexpr of a 4-bit moment (0: FP8)"""


def moment_format(f: MomentFormat | None) -> GroupFormat:
    """The fused steps' format constexpr of a moment stored in `f`: FP8 codes, 4-bit codes (its
    FP4 set; the FP8 fields then unused) or float32 (None: no field is read)."""
    fp4 = f is not None and isinstance(f.fmt, FP4Format)
    fmt = f.fmt if f is not None and not fp4 else FP8Format.E4M3
    code = (E2M1 if f.fmt is FP4Format.E2M1 else UE3M1_SQRT) if fp4 else 0
    return group_format(fmt, bool(f is not None and f.expand), code)


MIN_SCALE = tl.constexpr(_MIN_SCALE)


@triton.jit
def packed_offsets(gid, n_groups, cols, groups_per_row, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """Offsets into packed codes of shape (rows, ceil(cols / 2)) of groups `gid`, with their mask:
    the decoder loads this tile once and the encoder stores it. EVEN (every row is whole groups):
    int32 words [len(gid), GROUP // 8] (a group is GROUP // 2 bytes, a multiple of 16: the words
    are aligned); else bytes [len(gid), GROUP // 2] (GROUP is even: a group starts at a byte)."""
    HALF: tl.constexpr = GROUP // 2
    gmask = gid < n_groups
    if EVEN:
        return gid[:, None] * (HALF // 4) + tl.arange(0, HALF // 4)[None, :], gmask[:, None]
    else:
        row = gid // groups_per_row
        col0 = (gid - row * groups_per_row) * GROUP
        first = col0[:, None] + 2 * tl.arange(0, HALF)[None, :]  # the byte's first element
        return row[:, None] * ((cols + 1) // 2) + first // 2, gmask[:, None] & (first < cols)


@triton.jit
def _level(w, N: tl.constexpr, FMT: tl.constexpr):
    """Codebook values (float32) of nibble N (bits 4N..4N+3) of int32 words or bytes `w`, from the
    bits. ue3m1: code c is level (1 + (c & 1) / 2) * 2**(c >> 1), whose float32 pattern is
    (c << 22) + bits(1.0). e2m1 (sign in bit 3): the pattern (c & 7) << 22 with the sign at bit 31
    is the value times 2**-126 (0.5 becomes the subnormal 2**-127), so one exact multiply by
    2**126 gives it; the two fields are placed by one multiply (two shifted copies of the nibble
    that do not overlap) and one mask. Per nibble: 2 integer ops (ue3m1), 3 and a multiply (e2m1)."""
    NIB: tl.constexpr = 15 << (4 * N)
    if FMT == 1:
        KEEP: tl.constexpr = -2118123520  # 0x81C00000 as int32: bits 31 and 22..24
        if N < 6:
            bits = ((w & NIB) * ((1 << (22 - 4 * N)) + (1 << (28 - 4 * N)))) & KEEP
        elif N == 6:
            bits = (((w & NIB) >> 2) * 65) & KEEP
        else:
            bits = ((w >> 6) & 0x01C00000) | (w & -2147483648)
        return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126
    else:
        if N < 6:
            bits = (w & NIB) * (1 << (22 - 4 * N)) + 0x3F800000
        else:
            bits = ((w >> (4 * N - 22)) & 0x03C00000) + 0x3F800000
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _add_rn(a, b):
    """a + b rounded once: on the GPU add.rn.f32, which ptxas never contracts with the product
    that made a (an fma would round once where the twin rounds the product first)."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        return a + b


@triton.jit
def _nearest(y, FMT: tl.constexpr):
    """Code index (int32) of the level nearest to y (in [0, top * (1 + 2**-22)], clamped to the
    top level as the twin's encoder clamps it), ties to the even index, as formats.fp4._nearest's
    midpoint search. Checked exhaustively against the twin over every float32 in that range
    (tests/formats/exhaustive_fp4_nearest.py).

    ue3m1: the codebook is the 1-bit-mantissa floats from 1: rounding the pattern to nearest even
    at mantissa bit 22 gives 2 * biased exponent + mantissa bit, the code up to an offset (below
    1 only level 1 is nearer: clamp). e2m1: the levels are spaced 0.5 up to 2, then 1 up to 4,
    then 2, which is the ulp of C = 2**(e + 22) for y's exponent e clamped below at 0; so C + y,
    rounded once, is C plus y rounded to its nearest level, ties to an even count of spacings,
    and that count (its pattern less C's) is the code less 2e (y = 6 * (1 + 2**-22) still rounds
    to 6). Six integer/float ops an element, with no compare, select or clamp."""
    bits = y.to(tl.int32, bitcast=True)
    if FMT == 1:
        e = tl.maximum(bits & 0x7F800000, 0x3F800000)  # 2**e's pattern
        c = e + (22 << 23)
        return _add_rn(y, c.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - c + ((e >> 22) - 254)
    else:
        r = (bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22
        return tl.maximum(r - 254, 0)


@triton.jit
def _mul_rn(a, b):
    """a * b rounded once: on the GPU mul.rn.f32, which ptxas never contracts into a later add
    (an fma would round once where the twin rounds the product first)."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        return a * b


@triton.jit
def _decoded(w, N: tl.constexpr, step, FMT: tl.constexpr):
    if FMT == 2:
        u = _level(w, N, FMT) * step
        return u * u
    else:  # (m's decode feeds the update's g - m: kept a rounded product)
        return _mul_rn(_level(w, N, FMT), step)


@triton.jit
def load_decode4(code_ptrs, pmask, scale_ptrs, gmask, mask, GROUP: tl.constexpr, FMT: tl.constexpr,
                 EVEN: tl.constexpr):  # fmt: skip
    """float32 [groups, GROUP] values of a 4-bit moment (0 where `mask` is off) from the pointers
    to its packed codes (EVEN: int32 words, else bytes; `pmask`: see packed_offsets). The code
    tile is loaded once and each nibble's values are joined into the element tile, which stays in
    the thread's registers (a thread's words or bytes hold its elements). A second moment's NaN
    scale reads as +Inf, per group (formats.optimizer_state.SECOND_MOMENTS' rule: no NaN out).
    EVEN: `mask` is the groups' mask, whose scale loads as 0 and so decodes to exact zeros, so
    no select runs; on the GPU e2m1's decode multiply is mul.rn, which the compiler cannot fuse
    into the update's subtraction (an fma would round m once where the twin rounds it first;
    under the interpreter nothing fuses, and the select stays there)."""
    GPP: tl.constexpr = code_ptrs.shape[0]
    TOP: tl.constexpr = 6.0 if FMT == 1 else 192.0
    w = tl.load(code_ptrs, mask=pmask, other=0).to(tl.int32)
    scale = tl.load(scale_ptrs, mask=gmask, other=0.0)
    step = tl.math.div_rn(scale, tl.full(scale.shape, TOP, tl.float32))
    if FMT == 2:
        step = tl.where(step != step, float("inf"), step)
    step = step[:, None]
    if EVEN:  # element 8j + 4a + 2b + c is nibble 4a + 2b + c of word j
        e0 = tl.join(tl.join(_decoded(w, 0, step, FMT), _decoded(w, 4, step, FMT)),
                     tl.join(_decoded(w, 2, step, FMT), _decoded(w, 6, step, FMT)))  # fmt: skip
        e1 = tl.join(tl.join(_decoded(w, 1, step, FMT), _decoded(w, 5, step, FMT)),
                     tl.join(_decoded(w, 3, step, FMT), _decoded(w, 7, step, FMT)))  # fmt: skip
        x = tl.reshape(tl.join(e0, e1), [GPP, GROUP])
    else:  # element 2j + c is nibble c of byte j
        x = tl.reshape(tl.join(_decoded(w, 0, step, FMT), _decoded(w, 1, step, FMT)), [GPP, GROUP])
    if EVEN and (FMT == 2 or FAST_MATH):  # (v = u * u: a product the update's fma cannot absorb)
        return x
    else:
        return tl.where(mask, x, 0.0)


@triton.jit
def _sqrt_rn_fast(x):
    """sqrt_rn(x) bit for bit for x in [2**-101, 2**128) (and garbage elsewhere), in 5 instructions
    where sqrt_rn takes 10: this is the sequence ptxas itself emits for sqrt.rn.f32 (12.8, Triton
    3.6's, and 12.9 alike) once its range check passes (x's pattern - 0x0D000000 <= 0x727FFFFF,
    else a called slow path): MUFU.RSQ r, s = x * r, h = r / 2, e = fma(-s, s, x), fma(e, h, s).
    Explicit .rn keeps ptxas from contracting the products; all operands are normal, so .ftz
    changes nothing."""
    return tl.inline_asm_elementwise(
        """{
        .reg .f32 r, s, h, n, e;
        rsqrt.approx.ftz.f32 r, $1;
        mul.rn.ftz.f32 s, $1, r;
        mul.rn.ftz.f32 h, r, 0f3F000000;
        neg.f32 n, s;
        fma.rn.f32 e, n, s, $1;
        fma.rn.f32 $0, e, h, s;
        }""",
        "=r,r",
        [x],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


SQRT_FLOOR = tl.constexpr(2.0**-100)
"""ue3m1_sqrt on the GPU takes sqrt of max(v, SQRT_FLOOR): below, the code is 0 either way where
the group's largest v is at least 2**-84 (VMAX_FLOOR_BITS; see magnitudes4)"""
VMAX_FLOOR_BITS = tl.constexpr(0x15800000)
"""2**-84's float32 pattern"""


@triton.jit
def magnitudes4(x, FMT: tl.constexpr):
    """The first half of encode_store4: (|u|, the e2m1 sign bits (0 for ue3m1), each group's
    largest pattern, int32) of a [groups, G] float32 tile (u = sqrt(x) for ue3m1_sqrt). Split
    from quantize_store4 so that a step with two 4-bit moments can test both moments in one
    program-wide reduction (a shared-memory round trip and barriers each); rare_groups4 says
    which groups need quantize_store4's exact path.

    ue3m1_sqrt on the GPU: u = sqrt of max(v, 2**-100) by _sqrt_rn_fast, and the largest pattern
    is v's own (uint32: a set sign bit, a NaN or Inf ranks above every finite v >= 0). Where
    the group's largest v is 0 or at least 2**-84 and finite (else rare_groups4 holds), this
    gives the codes and scale of u = sqrt_rn(v) exactly: v >= 2**-100 lies in _sqrt_rn_fast's
    range; v < 2**-100 gets u <= 2**-50 both ways, and with scale = sqrt_rn(max v) >= 2**-42,
    top / scale <= 192 * 2**42 = 1.5 * 2**49 (exact), so y = u * (top / scale) <= 0.75 rounds
    to code 0 both ways (the first midpoint is 1.25); an all-zero group has scale 0 and y = 0."""
    if FMT == 2 and FAST_MATH:
        u = _sqrt_rn_fast(tl.maximum(x, SQRT_FLOOR))
        return u, 0, tl.max(x.to(tl.uint32, bitcast=True), axis=1).to(tl.int32, bitcast=True)
    if FMT == 2:
        u = tl.sqrt_rn(x)
    else:
        u = x
    mag = tl.abs(u)
    if FMT == 1:
        sign = (u < 0).to(tl.int32) << 3
    else:
        sign = 0
    return mag, sign, tl.max(mag.to(tl.int32, bitcast=True), axis=1)


@triton.jit
def rare_groups4(mx_bits, FMT: tl.constexpr):
    """Per group, from magnitudes4's largest pattern: whether quantize_store4 must take its exact
    path, or the non-finite count must look (|m| >= 2**127 or v >= 2**126: below both, m + v
    stays finite). Any group holding a NaN/Inf is one (its pattern is above 0x7F7FFFFF)."""
    if FMT == 2 and FAST_MATH:  # v's pattern: v >= 2**126, NaN/Inf/sign bit, or 0 < v max < 2**-84
        vm = mx_bits.to(tl.uint32, bitcast=True)
        return (vm > 0x7E7FFFFF) | (vm - 1 < VMAX_FLOOR_BITS - 1)
    elif FMT == 2:  # sqrt(v)'s pattern: sqrt(v) >= 2**63 holds wherever v >= 2**126
        return mx_bits > 0x5EFFFFFF
    else:
        return mx_bits > 0x7EFFFFFF


@triton.jit
def quantize_store4(x, mag, sign, mx_bits, rare, code_ptrs, pmask, scale_ptrs, gmask, GROUP: tl.constexpr,
                    FMT: tl.constexpr, EVEN: tl.constexpr, rbits, SR: tl.constexpr):  # fmt: skip
    """The second half of encode_store4, from the tile x and magnitudes4's results: `rare` (a
    scalar) must hold wherever rare_groups4 does for some group; it may hold elsewhere too (the
    exact path computes the same codes there)."""
    GPP: tl.constexpr = mag.shape[0]
    TOP: tl.constexpr = 6.0 if FMT == 1 else 192.0
    if FMT == 2 and FAST_MATH:  # scale = sqrt_rn(largest v), 2**-42 at least where it is used
        mx = tl.where(
            mx_bits != 0, _sqrt_rn_fast(tl.maximum(mx_bits.to(tl.float32, bitcast=True), SQRT_FLOOR)), 0.0
        )
    else:
        mx = mx_bits.to(tl.float32, bitcast=True)
    bad = mx_bits != mx_bits  # (no group holds a NaN/Inf unless rare)
    if rare:  # the exact path: NaN/Inf count as 0, a group holding one stores a NaN scale
        if FMT == 2 and FAST_MATH:  # (from v's patterns -0.0 would look like a NaN: the sign bit)
            mag = tl.abs(tl.sqrt_rn(x))
            bad = tl.max(mag.to(tl.int32, bitcast=True), axis=1) > 0x7F7FFFFF
        else:
            bad = mx_bits > 0x7F7FFFFF
        finite = mag < float("inf")
        mag = tl.where(finite, mag, 0.0)
        if FMT == 1:
            sign = tl.where(finite, sign, 0)
        mx = tl.max(mag, axis=1)
    scale = tl.where(mx > 0, tl.maximum(mx, MIN_SCALE), 0.0)
    to_units = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, TOP, tl.float32), scale), 0.0)
    # mag <= scale, so y <= top * (1 + 2**-23), which rounds to the top code as the twin's clamp
    # does
    y = mag * to_units[:, None]
    if SR:  # ue3m1_sqrt: clamp(((bits(y) + rbits) >> 22) - 254, 0, 15) as the twin's, in 3 ops
        # y <= top + 2 ulps (mag <= scale, to_units is top / scale rounded once, then the product)
        # and rbits <= 2**22 - 32 (fp4_moment.rounding_bits), so the sum stays below the pattern
        # of code 16: no upper clamp. (a >> 22) - 254 == (a - (254 << 22)) >> 22 for int32 a.
        c = tl.maximum((y.to(tl.int32, bitcast=True) + rbits - (254 << 22)) >> 22, 0)
    else:
        c = _nearest(y, FMT) + sign  # (e2m1: the sign is bit 3, above the code)
    lo, hi = tl.split(tl.reshape(c, [GPP, GROUP // 2, 2]))
    c = lo | (hi << 4)  # bytes
    if EVEN:  # int32 words, byte 0 lowest
        lo, hi = tl.split(tl.reshape(c, [GPP, GROUP // 4, 2]))
        lo, hi = tl.split(tl.reshape(lo | (hi << 8), [GPP, GROUP // 8, 2]))
        tl.store(code_ptrs, lo | (hi << 16), mask=pmask)
    else:
        tl.store(code_ptrs, c.to(tl.uint8), mask=pmask)
    store_per_group(scale_ptrs, tl.where(bad, float("nan"), scale), gmask)


@triton.jit
def encode_store4(x, code_ptrs, pmask, scale_ptrs, gmask, GROUP: tl.constexpr, FMT: tl.constexpr,
                  EVEN: tl.constexpr, rbits, SR: tl.constexpr):  # fmt: skip
    """Quantize a [groups, GROUP] float32 tile (exact zeros where the tile's mask is off: they
    give code 0) into a 4-bit moment and store its packed codes (EVEN: int32 words, else bytes:
    packed_offsets) and scales. A group with a NaN/Inf stores a NaN scale and takes its codes
    from the finite values, NaN/Inf counting as 0 (the twin's rule). The per-element checks for
    that run only in a program where rare_groups4 holds for a group (one that holds a NaN/Inf,
    among others): elsewhere the groups' largest magnitude is the maximum of the patterns |u|
    (as integers, ordered as the floats, NaN above Inf), and it is finite."""
    mag, sign, mx_bits = magnitudes4(x, FMT)
    rare = tl.max(rare_groups4(mx_bits, FMT).to(tl.int32), axis=0) > 0
    quantize_store4(
        x, mag, sign, mx_bits, rare, code_ptrs, pmask, scale_ptrs, gmask, GROUP, FMT, EVEN, rbits, SR
    )
