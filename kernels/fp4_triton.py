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

E2M1, UE3M1_SQRT = 1, 2
"""the FMT constexpr of a 4-bit moment (0: FP8)"""
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
def _nearest(y, FMT: tl.constexpr):
    """Code index (int32) of the level nearest to y (in [0, top]), ties to the even index, as
    formats.fp4._nearest's midpoint search, by rounding in float32 bits. Both codebooks are
    1-bit-mantissa floats above 1: rounding the pattern to nearest even at mantissa bit 22 gives
    2 * biased exponent + mantissa bit, the code up to an offset (ue3m1: below 1 only level 1 is
    nearer: clamp). e2m1 below 1 has the even spacing 0, 0.5, 1: there the code is 2y rounded to
    nearest even, the mantissa field of y + 2**22 (whose ulp is 0.5). Checked exhaustively
    against the twin over every float32 in [0, top] (tests/exhaustive_fp4_nearest.py)."""
    bits = y.to(tl.int32, bitcast=True)
    r = (bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22
    if FMT == 1:
        small = (y + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
        return tl.where(y < 1.0, small, r - 252)
    else:
        return tl.maximum(r - 254, 0)


@triton.jit
def _decoded(w, N: tl.constexpr, step, FMT: tl.constexpr):
    u = _level(w, N, FMT) * step
    return u * u if FMT == 2 else u


@triton.jit
def load_decode4(code_ptrs, pmask, scale_ptrs, gmask, mask, GROUP: tl.constexpr, FMT: tl.constexpr,
                 EVEN: tl.constexpr):  # fmt: skip
    """float32 [groups, GROUP] values of a 4-bit moment (0 where `mask` is off) from the pointers
    to its packed codes (EVEN: int32 words, else bytes; `pmask`: see packed_offsets). The code
    tile is loaded once and each nibble's values are joined into the element tile, which stays in
    the thread's registers (a thread's words or bytes hold its elements). A second moment's NaN
    scale reads as +Inf, per group (formats.optimizer_state.SECOND_MOMENTS' rule: no NaN out).
    EVEN: `mask` is the groups' mask, whose scale loads as 0 and so decodes to exact zeros; the
    select stays for e2m1 all the same: it keeps the compiler from fusing the decode's multiply
    into the update's subtraction (an fma would round m once where the twin rounds it first)."""
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
    if EVEN and FMT == 2:  # (v = u * u: a product the update's fma cannot absorb)
        return x
    else:
        return tl.where(mask, x, 0.0)


@triton.jit
def encode_store4(x, code_ptrs, pmask, scale_ptrs, gmask, GROUP: tl.constexpr, FMT: tl.constexpr,
                  EVEN: tl.constexpr, rbits, SR: tl.constexpr):  # fmt: skip
    """Quantize a [groups, GROUP] float32 tile (exact zeros where the tile's mask is off: they
    give code 0) into a 4-bit moment and store its packed codes (EVEN: int32 words, else bytes:
    packed_offsets) and scales. A group with a NaN/Inf stores a NaN scale and takes its codes
    from the finite values, NaN/Inf counting as 0 (the twin's rule). The per-element checks for
    that run only in a program that holds a NaN/Inf: elsewhere the groups' largest magnitude is
    the maximum of the patterns |u| (as integers, ordered as the floats, NaN above Inf), and it
    is finite. SR (ue3m1_sqrt): round stochastically with the 22 random bits `rbits` per element
    (int32, like x), as formats.fp4.encode_groups: added below ue3m1's mantissa bit and truncated.
    Returns the program's largest pattern |u| (int32; u = sqrt(x) for ue3m1_sqrt)."""
    GPP: tl.constexpr = x.shape[0]
    TOP: tl.constexpr = 6.0 if FMT == 1 else 192.0
    if FMT == 2:
        u = tl.sqrt_rn(x)
    else:
        u = x
    mag = tl.abs(u)
    if FMT == 1:
        sign = (u < 0).to(tl.int32) << 3
    mx_bits = tl.max(mag.to(tl.int32, bitcast=True), axis=1)
    mx = mx_bits.to(tl.float32, bitcast=True)
    bad = mx_bits > 0x7F7FFFFF  # a group holding a NaN/Inf
    top = tl.max(mx_bits, axis=0)
    if top > 0x7F7FFFFF:  # rare: NaN/Inf count as 0
        finite = mag < float("inf")
        mag = tl.where(finite, mag, 0.0)
        if FMT == 1:
            sign = tl.where(finite, sign, 0)
        mx = tl.max(mag, axis=1)
    scale = tl.where(mx > 0, tl.maximum(mx, MIN_SCALE), 0.0)
    to_units = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, TOP, tl.float32), scale), 0.0)
    # mag <= scale, so y <= top * (1 + 2**-23), which rounds to the top code as the twin's clamp
    # does; e2m1 keeps the clamp, which also stops the compiler from fusing the product into
    # _nearest's add (an fma would round once where the twin rounds y first)
    y = mag * to_units[:, None]
    if FMT == 1:
        c = _nearest(tl.minimum(y, TOP), FMT) | sign
    elif SR:  # (y just above top, by the product's rounding, lands on the top code as clamped)
        c = tl.minimum(tl.maximum(((y.to(tl.int32, bitcast=True) + rbits) >> 22) - 254, 0), 15)
    else:
        c = _nearest(y, FMT)
    lo, hi = tl.split(tl.reshape(c, [GPP, GROUP // 2, 2]))
    c = lo | (hi << 4)  # bytes
    if EVEN:  # int32 words, byte 0 lowest
        lo, hi = tl.split(tl.reshape(c, [GPP, GROUP // 4, 2]))
        lo, hi = tl.split(tl.reshape(lo | (hi << 8), [GPP, GROUP // 8, 2]))
        tl.store(code_ptrs, lo | (hi << 16), mask=pmask)
    else:
        tl.store(code_ptrs, c.to(tl.uint8), mask=pmask)
    tl.store(scale_ptrs, tl.where(bad, float("nan"), scale), mask=gmask)
    return top
