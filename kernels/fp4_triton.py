"""Triton device functions of the 4-bit moment formats (formats/fp4_moment.py, the twin).

A [groups, G] tile of a moment is stored as [groups, G/2] bytes (element 2j in the low nibble)
plus one float32 scale per group. Every operation mirrors the twin's float32 arithmetic in its
order: decode = level * (scale / top) with one correctly rounded division a group (then squared
for ue3m1_sqrt); encode = the nearest level of |u| * (top / scale), ties to the even code, found by
comparing against the exact midpoints (no float rounding, so the kernel and the twin agree bit
for bit wherever their inputs do). FMT: 1 = e2m1, 2 = ue3m1_sqrt.
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
    """Offsets into packed codes of shape (rows, ceil(cols / 2)) for groups `gid`: per element
    [len(gid), GROUP] (the byte each element is in: the decoder loads every byte twice, which the
    cache serves, instead of shuffling a byte tile into an element tile), and per byte
    [len(gid), GROUP // 2] with its mask (the encoder's stores). GROUP is even: a group starts at
    a byte."""
    HALF: tl.constexpr = GROUP // 2
    gmask = gid < n_groups
    if EVEN:
        boffs = gid[:, None] * HALF + tl.arange(0, HALF)[None, :]
        boffs = tl.max_contiguous(tl.multiple_of(boffs, [HALF, HALF]), [1, HALF])
        eoffs = (gid[:, None] * GROUP + tl.arange(0, GROUP)[None, :]) >> 1
        return eoffs, boffs, gmask[:, None]
    else:
        row = gid // groups_per_row
        col0 = (gid - row * groups_per_row) * GROUP
        start = row[:, None] * ((cols + 1) // 2)
        first = col0[:, None] + 2 * tl.arange(0, HALF)[None, :]  # the byte's first element
        eoffs = start + ((col0[:, None] + tl.arange(0, GROUP)[None, :]) >> 1)
        return eoffs, start + first // 2, gmask[:, None] & (first < cols)


@triton.jit
def _level(c, FMT: tl.constexpr):
    """Codebook value of int32 4-bit codes, built from the bits: e2m1 0, 0.5, 1, ..., 6 (sign in
    bit 3); ue3m1 (1 + (c & 1) / 2) * 2**(c >> 1)."""
    if FMT == 1:
        idx = c & 7
        e = idx >> 1
        normal = (((e + 126) << 23) | ((idx & 1) << 22)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, (idx & 1).to(tl.float32) * 0.5, normal)
        return tl.where(c >= 8, -mag, mag)
    else:
        return ((((c >> 1) + 127) << 23) | ((c & 1) << 22)).to(tl.float32, bitcast=True)


@triton.jit
def _nearest(y, FMT: tl.constexpr):
    """Code index of the level nearest to y (in [0, top]), ties to the even index: the number of
    midpoints below y, plus one where y is an odd-indexed midpoint (formats.fp4._nearest)."""
    if FMT == 1:  # midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5
        i = (y > 0.25).to(tl.int32) + (y > 0.75) + (y > 1.25) + (y > 1.75) + (y > 2.5) + (y > 3.5) + (y > 5.0)
        return i + ((y == 0.75) | (y == 1.75) | (y == 3.5)).to(tl.int32)
    else:  # midpoints 1.25 1.75 2.5 3.5 5 7 10 14 20 28 40 56 80 112 160
        i = (y > 1.25).to(tl.int32) + (y > 1.75) + (y > 2.5) + (y > 3.5) + (y > 5.0) + (y > 7.0) + (y > 10.0)
        i = i + (y > 14.0) + (y > 20.0) + (y > 28.0) + (y > 40.0) + (y > 56.0) + (y > 80.0)
        i = i + (y > 112.0) + (y > 160.0)
        tie = (y == 1.75) | (y == 3.5) | (y == 7.0) | (y == 14.0) | (y == 28.0) | (y == 56.0) | (y == 112.0)
        return i + tie.to(tl.int32)


@triton.jit
def load_decode4(byte_ptrs, scale_ptrs, gmask, mask, GROUP: tl.constexpr, FMT: tl.constexpr):
    """float32 [groups, GROUP] values of a 4-bit moment (0 where `mask` is off) from the pointers
    to each element's byte."""
    TOP: tl.constexpr = 6.0 if FMT == 1 else 192.0
    b = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    c = (b >> ((tl.arange(0, GROUP) & 1) * 4)[None, :]) & 15  # element 2j from the low nibble
    scale = tl.load(scale_ptrs, mask=gmask, other=0.0)
    step = tl.math.div_rn(scale, tl.full(scale.shape, TOP, tl.float32))
    u = _level(c, FMT) * step[:, None]
    x = u * u if FMT == 2 else u
    return tl.where(mask, x, 0.0)


@triton.jit
def encode_store4(x, code_ptrs, pmask, scale_ptrs, gmask, mask, GROUP: tl.constexpr, FMT: tl.constexpr):
    """Quantize a [groups, GROUP] float32 tile (0 where `mask` is off) into a 4-bit moment and
    store its packed codes and scales. A group with a NaN/Inf stores a NaN scale (the twin's rule)."""
    GPP: tl.constexpr = x.shape[0]
    TOP: tl.constexpr = 6.0 if FMT == 1 else 192.0
    if FMT == 2:
        u = tl.sqrt_rn(x)
    else:
        u = x
    finite = tl.abs(u) < float("inf")
    u = tl.where(finite, u, 0.0)
    mag = tl.abs(u)
    mx = tl.max(mag, axis=1)
    scale = tl.where(mx > 0, tl.maximum(mx, MIN_SCALE), 0.0)
    to_units = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, TOP, tl.float32), scale), 0.0)
    c = _nearest(tl.minimum(mag * to_units[:, None], TOP), FMT)
    if FMT == 1:
        c = c | ((u < 0).to(tl.int32) << 3)
    c = tl.where(mask, c, 0)
    lo, hi = tl.split(tl.reshape(c, [GPP, GROUP // 2, 2]))
    tl.store(code_ptrs, (lo | (hi << 4)).to(tl.uint8), mask=pmask)
    bad = tl.max((~finite).to(tl.int32), axis=1)
    tl.store(scale_ptrs, tl.where(bad > 0, float("nan"), scale), mask=gmask)
