"""The fused, multi-tensor CompressedAdamW step in Triton.

One pass per element: read p, g and the moments' FP8 codes with their per-group scale (and
exponent), update in float32 registers exactly in torch.optim.AdamW's order, write p, the new
codes and the new per-group scales/exponents. One launch covers every parameter of a param group
that shares dtypes and formats: a table of addresses says where each tensor lives and a table of
blocks says which groups of which tensor each program takes. Nothing synchronises with the host:
lr, the step counts, GradScaler's scale and found_inf are read on the device.

Host side (plans, launches, the custom op): kernels/adamw_launch.py. Twin: coatstate.optim.reference_step
(adamw_step_reference), the CPU path and the oracle.
A moment may instead be 4-bit (its format's FP4: packed codes and a scale per group, no exponents;
kernels/fp4_triton.py), in any mix with FP8.
With float32 p and g and FP8 moments an element moves about 16 bytes (p read and written, g read,
each moment's code read and written, the scales' share), so the copy bandwidth sets the floor.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from ..formats.fp4_moment import ROUNDING_STREAM as _ROUNDING_STREAM
from ..formats.optimizer_state import MomentFormat
from .fp4_triton import (
    UE3M1_SQRT,
    encode_store4,
    load_decode4,
    magnitudes4,
    moment_format,
    packed_offsets,
    quantize_store4,
    rare_groups4,
)
from .fp8_triton import FAST_MATH, encode_store, fast_divide, group_offsets, load_decode

# The tables that adamw_launch builds and the kernel reads, by column name. Triton reads module
# constants only as constexprs; the host lays a row out with by_column. The last name of each
# tuple is its row's width.
(P, G, M_CODES, M_SCALES, M_EXPS, V_CODES, V_SCALES, V_EXPS, X_CODES, X_SCALES, X_EXPS, STEP, C,
 TABLE_COLUMNS) = map(tl.constexpr, range(14))  # fmt: skip
"""The address table, int64, a row per tensor. P, G, each moment's codes (or float32 values) and C
(the master correction) hold element offsets from the launch's base tensors; a moment's scales and
exponents and STEP (the tensor's step count) hold addresses. X is AMSGrad's running maximum of v."""
TO_SCALES, TO_EXPS = M_SCALES - M_CODES, M_EXPS - M_CODES
"""a moment's scales and exponents columns, counted from its codes column (alike for M, V and X)"""
N_COLS, GROUPS_PER_ROW, N_GROUPS, SEED, FIRST, META_COLUMNS = map(tl.constexpr, range(6))
"""The meta table, int64, a row per tensor: its columns, groups per row and groups, the seed of its
stochastic roundings (master_bits=16, a 4-bit second moment), its first element in its global
tensor (mod 2**32)."""
BLOCK_TENSOR, BLOCK_INDEX, BLOCK_COLUMNS = map(tl.constexpr, range(3))
"""The blocks table, int32, a row per program: the tensor it takes and which GPP groups of it."""
DECAY, W1, B2, W2, EPS, HYPER_COLUMNS = map(tl.constexpr, range(6))
"""The launch's hyperparameters, float32: 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps."""
STEP_SIZE, INV_BC2_SQRT, SCALAR_COLUMNS = map(tl.constexpr, range(3))
"""Per tensor, float32, at its step t: lr / (1 - beta1**t), 1 / sqrt(1 - beta2**t)."""
BAD_VALUES, BAD_STEPS, LAST_BAD_STEP, NONFINITE_COLUMNS = map(tl.constexpr, range(4))
"""The non-finite counters, int32, a row per tensor: moment values that came out NaN/Inf, steps
with any, the last such step."""
STOCHASTIC_FP4 = tl.constexpr(UE3M1_SQRT)
"""the 4-bit format whose codes round stochastically"""
ROUNDING_STREAM = tl.constexpr(_ROUNDING_STREAM)
# The launch: small programs (one warp over two groups) with registers capped so that more warps
# stay resident per SM and hide the step's memory latency; the sweep of
# benchmarks/whole_state_step.py chose it (docs/benchmarks.md), and benchmarks set others.
GROUPS_PER_PROGRAM = 2
NUM_WARPS = 1
MAX_REGISTERS = 64
"""registers a thread may use (Triton's maxnreg; None: ptxas decides)"""
INTERPRETER_GROUPS_PER_PROGRAM: int | None = 128
"""groups per program under Triton's CPU interpreter (tests), where each program costs host time,
so one program covers most test tensors; None launches
GROUPS_PER_PROGRAM there too (the tests of the default launch)"""


def by_column(values: dict, width, fill=None) -> list:
    """A table row from `values` ({column name above: value}) in column order, absent columns
    `fill` (where fill is None, every column must be given)."""
    row = [fill] * int(width)
    for column, value in values.items():
        row[column] = value  # (a constexpr indexes a list as its int)
    assert all(v is not None for v in row), f"no value for some of columns 0..{int(width) - 1}: {row}"
    return row


def format_constexprs(fm: MomentFormat | None, fv: MomentFormat | None) -> dict:
    """The kernel's M_FMT and V_FMT for moments stored in `fm` (exp_avg) and `fv` (the others)."""
    return {"M_FMT": moment_format(fm), "V_FMT": moment_format(fv)}


def groups_per_program(interpreting: bool) -> int:
    """The launch's groups per program (the kernel's GPP and its grid)."""
    if interpreting and INTERPRETER_GROUPS_PER_PROGRAM is not None:
        return INTERPRETER_GROUPS_PER_PROGRAM
    return GROUPS_PER_PROGRAM


def launch_options() -> dict:
    """Triton's launch options for the step: its warps and, when set, its register cap (read at
    each call: benchmarks set the module's values to compare launches)."""
    return {"num_warps": NUM_WARPS, **({"maxnreg": MAX_REGISTERS} if MAX_REGISTERS else {})}


class _Tile(NamedTuple):
    """A program's elements: the offsets and mask of its [GPP, GROUP] tile, its groups and their
    mask, and the offsets and mask of their packed 4-bit codes (the element tile's where no moment
    is 4-bit)."""

    offs: tl.tensor
    mask: tl.tensor
    gid: tl.tensor
    gmask: tl.tensor
    poffs: tl.tensor
    pmask: tl.tensor


class _Hyper(NamedTuple):
    """The update's scalars: the launch's hyperparameters and the tensor's step size and bias
    correction (the tables' DECAY ... EPS, STEP_SIZE, INV_BC2_SQRT)."""

    decay: tl.tensor
    w1: tl.tensor
    b2: tl.tensor
    w2: tl.tensor
    eps: tl.tensor
    step_size: tl.tensor
    inv_bc2_sqrt: tl.tensor


@triton.jit
def _data(base_ptr, row_ptr, COL: tl.constexpr, offs):
    """Pointers to a tensor's elements: a typed base pointer plus the tensor's element offset
    from it (a multiple of 16 bytes, so the compiler may use 16-byte vector loads)."""
    vec: tl.constexpr = 128 // base_ptr.dtype.element_ty.primitive_bitwidth
    delta = tl.multiple_of(tl.load(row_ptr + COL), vec)
    return base_ptr + delta + offs


@triton.jit
def _packed(base_ptr, row_ptr, COL: tl.constexpr, offs, EVEN: tl.constexpr):
    """Pointers to a 4-bit moment's packed codes at `offs` (packed_offsets): EVEN, int32 words
    (the tensor's offset from the uint8 base is a multiple of 16 bytes), else bytes."""
    if EVEN:
        delta = tl.multiple_of(tl.load(row_ptr + COL), 16)
        return (base_ptr + delta).to(tl.pointer_type(tl.int32)) + offs
    else:
        return _data(base_ptr, row_ptr, COL, offs)


@triton.jit
def _group_pointers(row_ptr, CODES: tl.constexpr, gid, EXPAND: tl.constexpr):
    """Pointers to the per-group scales and exponent codes of groups `gid` of the moment whose
    codes are in column CODES of a tensor's table row (the exponent pointer is unused without
    expansion)."""
    scales = tl.load(row_ptr + CODES + TO_SCALES).to(tl.pointer_type(tl.float32)) + gid
    if EXPAND:
        exps = tl.load(row_ptr + CODES + TO_EXPS).to(tl.pointer_type(tl.uint8)) + gid
    else:
        exps = scales
    return scales, exps


@triton.jit
def _pointers4(base_ptr, row_ptr, CODES: tl.constexpr, tile, EVEN: tl.constexpr):
    """A 4-bit moment's pointers: to its packed codes at the tile's and to its groups' scales."""
    codes = _packed(base_ptr, row_ptr, CODES, tile.poffs, EVEN)
    return codes, _group_pointers(row_ptr, CODES, tile.gid, False)[0]


@triton.jit
def _step(row_ptr):
    """The tensor's step count (float32, already counting this step)."""
    return tl.load(tl.load(row_ptr + STEP).to(tl.pointer_type(tl.float32)))


@triton.jit
def _tile(meta_ptr, local_block, GROUP: tl.constexpr, GPP: tl.constexpr, EVEN: tl.constexpr,
          PACKED: tl.constexpr):  # fmt: skip
    """The tile of block `local_block` of the tensor whose meta row is at `meta_ptr`. PACKED: a
    moment is 4-bit (its codes' byte offsets cover the same groups)."""
    cols = tl.load(meta_ptr + N_COLS)
    groups_per_row = tl.load(meta_ptr + GROUPS_PER_ROW)
    n_groups = tl.load(meta_ptr + N_GROUPS)
    gid = local_block.to(tl.int64) * GPP + tl.arange(0, GPP)
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    if PACKED:
        poffs, pmask = packed_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    else:
        poffs, pmask = offs, mask
    return _Tile(offs, mask, gid, gid < n_groups, poffs, pmask)


@triton.jit
def _hyper(hyper_ptr, scalars_ptr, t):
    """The update's scalars (adamw_launch._scalars): the launch's and tensor t's."""
    decay, w1, b2 = tl.load(hyper_ptr + DECAY), tl.load(hyper_ptr + W1), tl.load(hyper_ptr + B2)
    w2, eps = tl.load(hyper_ptr + W2), tl.load(hyper_ptr + EPS)
    scalars = scalars_ptr + t * SCALAR_COLUMNS
    return _Hyper(decay, w1, b2, w2, eps, tl.load(scalars + STEP_SIZE), tl.load(scalars + INV_BC2_SQRT))


@triton.jit
def _load_master(p_raw, c_ptrs, mask, MASTER: tl.constexpr):
    """The float32 master of bfloat16 weights `p_raw` and their corrections (formats.master_weights)."""
    if MASTER == 32:
        high = p_raw.to(tl.int16, bitcast=True).to(tl.int32)
        rem = tl.load(c_ptrs, mask=mask, other=0).to(tl.int32)
        x = ((high << 16) + rem).to(tl.float32, bitcast=True)
        return tl.where(p_raw != p_raw, p_raw.to(tl.float32), x)
    elif MASTER == 24:
        w = p_raw.to(tl.float32)  # exact: the pattern shifted up 16 bits
        s = _correction_bits(w.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        c = tl.load(c_ptrs, mask=mask, other=0).to(tl.float32)
        return w + c * s  # (an fma is the same: c * s is exact)
    else:
        return p_raw.to(tl.float32)


@triton.jit
def _load_param(p_base, c_base, row_ptr, tile, MASTER: tl.constexpr):
    """The float32 parameters (the masters of bfloat16 weights where MASTER > 0) and the pointers
    their store takes: the weights' and the corrections'."""
    p_ptrs = _data(p_base, row_ptr, P, tile.offs)
    if MASTER > 0:
        c_ptrs = _data(c_base, row_ptr, C, tile.offs)
        p = _load_master(tl.load(p_ptrs, mask=tile.mask, other=0.0), c_ptrs, tile.mask, MASTER)
    else:
        c_ptrs = p_ptrs
        p = tl.load(p_ptrs, mask=tile.mask, other=0.0).to(tl.float32)
    return p, p_ptrs, c_ptrs


@triton.jit
def _load_grad(g_base, row_ptr, tile, grad_scale_ptr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr):
    """The float32 gradients, unscaled (GradScaler's inverse scale) and negated to maximize."""
    g = tl.load(_data(g_base, row_ptr, G, tile.offs), mask=tile.mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _load_moment(base_ptr, row_ptr, CODES: tl.constexpr, tile, COMPRESSED: tl.constexpr, FMT: tl.constexpr,
                 NAN_IS_INF: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """A moment's float32 values and, where it is 4-bit, its codes' and scales' pointers, which its
    store takes again (the table reads and 64-bit adds are not repeated). NAN_IS_INF: a second
    moment, whose FP8 NaN code reads as +Inf (formats.optimizer_state.SECOND_MOMENTS; a 4-bit
    decoder does it per group). A moment not 4-bit gives (0, 0) for the pointers."""
    if COMPRESSED and FMT.FP4 > 0:
        codes, scales = _pointers4(base_ptr, row_ptr, CODES, tile, EVEN)
        x = load_decode4(codes, tile.pmask, scales, tile.gmask, tile.mask, GROUP, FMT.FP4, EVEN)
        return x, (codes, scales)
    elif COMPRESSED:
        scales, exps = _group_pointers(row_ptr, CODES, tile.gid, FMT.EXPAND)
        x = load_decode(_data(base_ptr, row_ptr, CODES, tile.offs), scales, exps, tile.mask, tile.gmask, FMT)
        if NAN_IS_INF:
            x = tl.where(x != x, float("inf"), x)
        return x, (0, 0)
    else:
        return tl.load(_data(base_ptr, row_ptr, CODES, tile.offs), mask=tile.mask, other=0.0), (0, 0)


@triton.jit
def _update_moments(p, g, m, v, h):
    """AdamW's decayed p and new m and v, in float32 in torch.optim.AdamW's order."""
    p = p * h.decay
    if h.w1 < 0.5:  # torch.lerp's two formulas
        m = m + h.w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - h.w1)
    v = v * h.b2 + h.w2 * g * g
    return p, m, v


@triton.jit
def _update_param(p, m, v, h):
    """AdamW's step of the decayed p from the new m and v (with AMSGRAD, v's running maximum)."""
    denom = tl.sqrt(v) * h.inv_bc2_sqrt + h.eps
    return p - h.step_size * fast_divide(m, denom)  # approximate division: 2 ulp


@triton.jit
def _mix32(h):
    """murmur3's finalizer on uint32 (wrapping), as formats.rounding_hash._mix32."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B).to(tl.uint32)
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35).to(tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _hash32(seed, step, offs, STREAM: tl.constexpr):
    """32 random bits (uint32) per element offset, as formats.rounding_hash.hash32 (`seed` here
    is already times 0x9E3779B1: the launch's meta holds it so)."""
    key = (seed + (step.to(tl.int32).to(tl.uint32) * 0x632BE5AB).to(tl.uint32)).to(tl.uint32)
    key = _mix32((key + STREAM).to(tl.uint32))
    return _mix32((offs.to(tl.uint32) * 0x85EBCA77).to(tl.uint32) ^ key)


@triton.jit
def _rounding_bits(seed, step, gid, goffs, first, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """fp4_moment.rounding_bits (int32) of the tile's elements at global offsets `goffs`: one
    hash a pair of neighbours, its low 16 bits to the even offset. EVEN: the tile's pairs are
    whole (with a 4-bit v, _Plan.launch_even asks every tensor's first global offset be even), so the
    hash runs on the [groups, GROUP / 2] tile of pairs and its halves are joined in the
    registers of the thread that holds both elements; else once an element."""
    if EVEN:
        # (offset mod 2**32) // 2, in uint32: the mask wraps a run of pairs that crosses 2**32
        base = (gid.to(tl.uint32) * GROUP + first.to(tl.uint32)).to(tl.uint32) >> 1
        pairs = (base[:, None] + tl.arange(0, GROUP // 2)[None, :].to(tl.uint32)) & 0x7FFFFFFF
        h = _hash32(seed, step, pairs, ROUNDING_STREAM)
        r = tl.reshape(tl.join(h & 0xFFFF, h >> 16), [gid.shape[0], GROUP])
    else:
        o = goffs.to(tl.uint32)
        r = (_hash32(seed, step, o >> 1, ROUNDING_STREAM) >> ((o & 1) * 16)) & 0xFFFF
    return ((r << 6) | 32).to(tl.int32)


@triton.jit
def _rounding(meta_ptr, row_ptr, tile, MASTER: tl.constexpr, SR_V: tl.constexpr, GROUP: tl.constexpr,
              EVEN: tl.constexpr):  # fmt: skip
    """The stochastic roundings' keys (seed, step, the elements' offsets in the global tensor) and
    a 4-bit v's rounding bits (SR_V; else 0): master_bits=16 and SR_V hash them."""
    if MASTER == 16 or SR_V:
        seed = tl.load(meta_ptr + SEED).to(tl.uint32)
        step = _step(row_ptr)
        first = tl.load(meta_ptr + FIRST)
        goffs = tile.offs + first
    else:
        seed = 0
        step = 0.0
        goffs = tile.offs
    if SR_V:
        rbits = _rounding_bits(seed, step, tile.gid, goffs, first, GROUP, EVEN)
    else:
        rbits = 0
    return seed, step, goffs, rbits


@triton.jit
def _correction_bits(wbits):
    """The float32 pattern of s = ulp(w) / 256 (formats.master_weights.correction_scale) from
    the float32 pattern `wbits` (int32) of bfloat16 weights: its exponent field, clamped below
    at 16 and less 15, kept in place (field << 23) so that no shift or 16-bit unpacking runs."""
    return tl.maximum(wbits & 0x7F800000, 16 << 23) - (15 << 23)


@triton.jit
def _round_to_int8(c):
    """int8 of float32 c as the twin's round(c).clamp(-128, 127), NaN -> 0 (formats.master_weights
    .split24). On the GPU one conversion does it all: cvt.rni.s8.f32 rounds to nearest even,
    saturates to the int8 range (PTX clamps float-to-integer results to the destination's range)
    and turns NaN into 0 (its rule for NaN inputs), where the portable rounding, clamps and NaN
    select below take several instructions an element (and hardware min/max would drop a NaN)."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("cvt.rni.s8.f32 $0, $1;", "=r,r", [c], dtype=tl.int32, is_pure=True,
                                         pack=1).to(tl.int8)  # fmt: skip
    else:
        c = (c + 12582912.0) - 12582912.0  # to nearest integer, ties to even (|c| <= 2**22 here)
        c = tl.minimum(tl.maximum(c, -128.0), 127.0)
        return tl.where(c == c, c, 0.0).to(tl.int8)


@triton.jit
def _to_bf16(p):
    """float32 -> bfloat16 to nearest even by the GPU's paired conversion (cvt.rn.bf16x2.f32:
    element 2j from the second operand into the low half; p.to(bfloat16) converts one element
    an instruction). At every non-NaN p that is the twin's integer rounding and a NaN stays a
    NaN (tests/optim/test_master_weights.py checks all 2**32 float32 on the GPU)."""
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)  # fmt: skip


@triton.jit
def _store_master(p, p_ptrs, c_ptrs, mask, offs, seed, step, MASTER: tl.constexpr):
    """Write float32 masters `p` as bfloat16 weights (+ corrections), as formats.master_weights."""
    bits = p.to(tl.int32, bitcast=True)
    if MASTER == 32:
        high = (bits + 0x8000) >> 16  # to nearest, ties away from zero
        tl.store(c_ptrs, (bits - (high << 16)).to(tl.int16), mask=mask)
    elif MASTER == 24:
        if FAST_MATH:
            # the GPU's paired conversion (cvt.rn.bf16x2.f32, fewer instructions than the integer
            # rounding below and the store's NaN select) rounds to nearest even as that integer
            # rounding does at every non-NaN p: bfloat16 keeps float32's exponent field, so
            # rounding the pattern's low half is IEEE rounding, subnormals, carries into the
            # exponent and overflow to Inf included; a NaN stays a NaN, as the store below keeps
            # it (its c is NaN, stored as 0, either way)
            wb = _to_bf16(p)
            w = wb.to(tl.float32)
            wbits = w.to(tl.int32, bitcast=True)
        else:
            high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even
            wbits = high << 16
            w = wbits.to(tl.float32, bitcast=True)
        # 1 / s from the exponent field of s, a normal power of two (the two fields add to 254)
        inv_s = ((254 << 23) - _correction_bits(wbits)).to(tl.float32, bitcast=True)
        c = (p - w) * inv_s  # exact: a difference of neighbours times a power of two
        tl.store(c_ptrs, _round_to_int8(c), mask=mask)
    else:
        r = _hash32(seed, step, offs, 0) & 0xFFFF  # master_weights.random_bits
        high = (bits.to(tl.uint32, bitcast=True) + r) >> 16
        high = high.to(tl.int32, bitcast=True)
    if MASTER == 24 and FAST_MATH:
        tl.store(p_ptrs, wb, mask=mask)
    else:
        w = (high << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low bits are zero
        tl.store(p_ptrs, tl.where(p != p, p.to(tl.bfloat16), w), mask=mask)


@triton.jit
def _store_moment(x, at4, base_ptr, row_ptr, CODES: tl.constexpr, tile, COMPRESSED: tl.constexpr,
                  FMT: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr, rbits,
                  SR: tl.constexpr):  # fmt: skip
    """Store a moment's values `x` in its format; `at4`: a 4-bit moment's pointers from _load_moment."""
    if COMPRESSED and FMT.FP4 > 0:
        if at4 is None:  # (computed again rather than held through the update: registers)
            at4 = _pointers4(base_ptr, row_ptr, CODES, tile, EVEN)
        codes, scales = at4
        encode_store4(x, codes, tile.pmask, scales, tile.gmask, GROUP, FMT.FP4, EVEN, rbits, SR)
    elif COMPRESSED:
        scales, exps = _group_pointers(row_ptr, CODES, tile.gid, FMT.EXPAND)
        encode_store(x, _data(base_ptr, row_ptr, CODES, tile.offs), scales, exps, tile.mask, tile.gmask, FMT)
    else:
        tl.store(_data(base_ptr, row_ptr, CODES, tile.offs), x, mask=tile.mask)


@triton.jit
def _store_both4(m, v, m_at, v_at, tile, rbits, row_ptr, nonfinite_ptr, t, M_FMT: tl.constexpr,
                 V_FMT: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """Store 4-bit m and v and count non-finite values: one program-wide reduction decides both
    encoders' exact path and the count (a reduction across warps is a shared-memory round trip
    with two barriers)."""
    m_codes, m_scales = m_at
    v_codes, v_scales = v_at
    m_mag, m_sign, m_mx = magnitudes4(m, M_FMT.FP4)
    v_mag, v_sign, v_mx = magnitudes4(v, V_FMT.FP4)
    flag = rare_groups4(m_mx, M_FMT.FP4) | rare_groups4(v_mx, V_FMT.FP4)
    rare = tl.max(flag.to(tl.int32), axis=0) > 0
    quantize_store4(m, m_mag, m_sign, m_mx, rare, m_codes, tile.pmask, m_scales, tile.gmask, GROUP, M_FMT.FP4,
                    EVEN, 0, False)  # fmt: skip
    quantize_store4(v, v_mag, v_sign, v_mx, rare, v_codes, tile.pmask, v_scales, tile.gmask, GROUP, V_FMT.FP4,
                    EVEN, rbits, V_FMT.FP4 == STOCHASTIC_FP4)  # fmt: skip
    if rare:  # rare (it holds wherever m + v is not finite)
        _count_nonfinite(m, v, row_ptr, nonfinite_ptr, t, False)


@triton.jit
def _count_nonfinite(m, v, row_ptr, nonfinite_ptr, t, SUM_FIRST: tl.constexpr):
    """Count non-finite moments (a NaN/Inf gradient): reported by CompressedAdamW, never hidden.
    Per parameter: values, steps with any, the last such step (the first program of a step to
    raise the last step counts the step). SUM_FIRST: a float sum of m + v decides first whether
    to count (a sum with a NaN or an Inf term is NaN or Inf, whatever the signs; a finite sum that
    overflows only sends the program to a count that finds nothing). That skips a compare and a
    select an element for FP8 moments; where a moment is 4-bit it costs registers, so the launch
    does not take it there."""
    s = m + v
    if SUM_FIRST:
        total = tl.sum(tl.sum(s, axis=1), axis=0)
        if total - total != 0:  # rare
            _count_nonfinite_exact(s, row_ptr, nonfinite_ptr, t)
    else:
        _count_nonfinite_exact(s, row_ptr, nonfinite_ptr, t)


@triton.jit
def _count_nonfinite_exact(s, row_ptr, nonfinite_ptr, t):
    """_count_nonfinite's count of the non-finite elements of s = m + v."""
    bad = tl.sum(tl.sum(((s - s) != 0).to(tl.int32), axis=1), axis=0)
    if bad > 0:
        step_now = _step(row_ptr).to(tl.int32)
        counts = nonfinite_ptr + t * NONFINITE_COLUMNS
        tl.atomic_add(counts + BAD_VALUES, bad)
        if tl.atomic_max(counts + LAST_BAD_STEP, step_now) < step_now:
            tl.atomic_add(counts + BAD_STEPS, 1)


@triton.jit
def _adamw_kernel(p_base, g_base, m_base, v_base, x_base, c_base, table_ptr, meta_ptr, blocks_ptr, hyper_ptr,
                  scalars_ptr, found_inf_ptr, grad_scale_ptr, nonfinite_ptr, COMPRESSED: tl.constexpr,
                  AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_SCALE: tl.constexpr,
                  HAS_INF: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, EVEN: tl.constexpr,
                  MASTER: tl.constexpr, M_FMT: tl.constexpr, V_FMT: tl.constexpr):  # fmt: skip
    """One program of the step: GPP groups of one tensor. M_FMT, V_FMT: the moments' formats
    (fp8_triton.GroupFormat; X takes V's), read where COMPRESSED; MASTER: master_bits or 0."""
    if HAS_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + pid * BLOCK_COLUMNS + BLOCK_TENSOR).to(tl.int64)
    local_block = tl.load(blocks_ptr + pid * BLOCK_COLUMNS + BLOCK_INDEX)
    row_ptr = table_ptr + t * TABLE_COLUMNS
    meta = meta_ptr + t * META_COLUMNS
    tile = _tile(meta, local_block, GROUP, GPP, EVEN, M_FMT.FP4 + V_FMT.FP4 > 0)
    h = _hyper(hyper_ptr, scalars_ptr, t)

    p, p_ptrs, c_ptrs = _load_param(p_base, c_base, row_ptr, tile, MASTER)
    g = _load_grad(g_base, row_ptr, tile, grad_scale_ptr, HAS_SCALE, MAXIMIZE)
    m, m_at = _load_moment(m_base, row_ptr, M_CODES, tile, COMPRESSED, M_FMT, False, GROUP, EVEN)
    v, v_at = _load_moment(v_base, row_ptr, V_CODES, tile, COMPRESSED, V_FMT, True, GROUP, EVEN)
    p, m, v = _update_moments(p, g, m, v, h)
    if AMSGRAD:  # v's running maximum, read only now (fewer registers held through the update)
        vmax, _ = _load_moment(x_base, row_ptr, X_CODES, tile, COMPRESSED, V_FMT, True, GROUP, EVEN)
        vmax = tl.maximum(vmax, v)
        p = _update_param(p, m, vmax, h)
    else:
        p = _update_param(p, m, v, h)

    SR_V: tl.constexpr = COMPRESSED and V_FMT.FP4 == STOCHASTIC_FP4
    seed, step, goffs, rbits = _rounding(meta, row_ptr, tile, MASTER, SR_V, GROUP, EVEN)
    if MASTER > 0:
        _store_master(p, p_ptrs, c_ptrs, tile.mask, goffs, seed, step, MASTER)
    else:
        tl.store(p_ptrs, p.to(p_base.dtype.element_ty), mask=tile.mask)
    if COMPRESSED and M_FMT.FP4 > 0 and V_FMT.FP4 > 0:
        _store_both4(m, v, m_at, v_at, tile, rbits, row_ptr, nonfinite_ptr, t, M_FMT, V_FMT, GROUP, EVEN)
    else:
        _store_moment(m, m_at, m_base, row_ptr, M_CODES, tile, COMPRESSED, M_FMT, GROUP, EVEN, 0, False)
        _store_moment(v, v_at, v_base, row_ptr, V_CODES, tile, COMPRESSED, V_FMT, GROUP, EVEN, rbits, SR_V)
        _count_nonfinite(m, v, row_ptr, nonfinite_ptr, t, M_FMT.FP4 + V_FMT.FP4 == 0)
    if AMSGRAD:
        _store_moment(vmax, None, x_base, row_ptr, X_CODES, tile, COMPRESSED, V_FMT, GROUP, EVEN, 0, False)
