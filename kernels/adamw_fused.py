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
Bytes moved per element with fp32 p and g: p 4+4, g 4, codes 1+1 per moment, scales ~5/128 per
moment: about 16.1 bytes, so the floor is numel * 16.1 / copy bandwidth.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats.fp4_moment import ROUNDING_STREAM as _ROUNDING_STREAM
from ..formats.optimizer_state import MomentFormat
from .fp4_triton import (
    encode_store4,
    load_decode4,
    magnitudes4,
    moment_format,
    packed_offsets,
    quantize_store4,
    rare_groups4,
)
from .fp8_triton import FAST_MATH, encode_store, fast_divide, group_offsets, load_decode

# columns of the address table
P, G, M_CODES, M_SCALES, M_EXPS, V_CODES, V_SCALES, V_EXPS, X_CODES, X_SCALES, X_EXPS, STEP, C = range(13)
NPTR = 13
META = 5
"""per tensor: columns, groups per row, groups, the seed of the stochastic roundings (master_bits=16,
a 4-bit second moment), the local tensor's first element in its global tensor (mod 2**32)"""
ROUNDING_STREAM = tl.constexpr(_ROUNDING_STREAM)
# The launch: small programs (one warp over two groups) with registers capped so that more warps
# stay resident per SM and hide the step's memory latency. The fastest or tied launch for every
# moment format in whole_state_step.py's sweep on the GPU (docs/benchmarks.md); benchmarks set
# others to compare.
GROUPS_PER_PROGRAM = 2
NUM_WARPS = 1
MAX_REGISTERS = 64
"""registers a thread may use (Triton's maxnreg; None: ptxas decides)"""
INTERPRETER_GROUPS_PER_PROGRAM: int | None = 128
"""groups per program under Triton's CPU interpreter (tests), where each program costs host time,
so one program covers most test tensors; None launches
GROUPS_PER_PROGRAM there too (the tests of the default launch)"""


def groups_per_program(interpreting: bool) -> int:
    """The launch's groups per program (the kernel's GPP and its grid)."""
    if interpreting and INTERPRETER_GROUPS_PER_PROGRAM is not None:
        return INTERPRETER_GROUPS_PER_PROGRAM
    return GROUPS_PER_PROGRAM


def launch_options() -> dict:
    """Triton's launch options for the step: its warps and, when set, its register cap (read at
    each call: benchmarks set the module's values to compare launches)."""
    return {"num_warps": NUM_WARPS, **({"maxnreg": MAX_REGISTERS} if MAX_REGISTERS else {})}


DATA_COLUMNS = (P, G, M_CODES, V_CODES, X_CODES, C)
"""columns holding element offsets from the launch's base tensor; the others hold addresses"""


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
def _group_pointers(row_ptr, COL: tl.constexpr, gid, EXPAND: tl.constexpr):
    """Pointers to the per-group scales and exponent codes of groups `gid` of the moment in
    column COL of a tensor's table row (the exponent pointer is unused without expansion)."""
    scales = tl.load(row_ptr + COL + 1).to(tl.pointer_type(tl.float32)) + gid
    if EXPAND:
        exps = tl.load(row_ptr + COL + 2).to(tl.pointer_type(tl.uint8)) + gid
    else:
        exps = scales
    return scales, exps


@triton.jit
def _load_moment(base_ptr, row_ptr, COL: tl.constexpr, offs, mask, gid, gmask, poffs, pmask,
                 COMPRESSED: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                 EVEN: tl.constexpr):  # fmt: skip
    if COMPRESSED and FMT.FP4 > 0:  # packed 4-bit codes: the byte tile at `poffs` (kernels/fp4_triton.py)
        scales, _ = _group_pointers(row_ptr, COL, gid, False)
        codes = _packed(base_ptr, row_ptr, COL, poffs, EVEN)
        return load_decode4(codes, pmask, scales, gmask, mask, GROUP, FMT.FP4, EVEN)
    elif COMPRESSED:
        scales, exps = _group_pointers(row_ptr, COL, gid, FMT.EXPAND)
        return load_decode(_data(base_ptr, row_ptr, COL, offs), scales, exps, mask, gmask, FMT)
    else:
        return tl.load(_data(base_ptr, row_ptr, COL, offs), mask=mask, other=0.0)


@triton.jit
def _store_moment(x, base_ptr, row_ptr, COL: tl.constexpr, offs, mask, gid, gmask, COMPRESSED: tl.constexpr,
                  FMT: tl.constexpr, poffs, pmask, GROUP: tl.constexpr, EVEN: tl.constexpr, rbits,
                  SR: tl.constexpr):  # fmt: skip
    if COMPRESSED and FMT.FP4 > 0:
        scales, _ = _group_pointers(row_ptr, COL, gid, False)
        codes = _packed(base_ptr, row_ptr, COL, poffs, EVEN)
        encode_store4(x, codes, pmask, scales, gmask, GROUP, FMT.FP4, EVEN, rbits, SR)
    elif COMPRESSED:
        scales, exps = _group_pointers(row_ptr, COL, gid, FMT.EXPAND)
        encode_store(x, _data(base_ptr, row_ptr, COL, offs), scales, exps, mask, gmask, FMT)
    else:
        tl.store(_data(base_ptr, row_ptr, COL, offs), x, mask=mask)


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
        step_now = tl.load(tl.load(row_ptr + 11).to(tl.pointer_type(tl.float32))).to(tl.int32)
        tl.atomic_add(nonfinite_ptr + 3 * t, bad)
        if tl.atomic_max(nonfinite_ptr + 3 * t + 2, step_now) < step_now:
            tl.atomic_add(nonfinite_ptr + 3 * t + 1, 1)


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
    saturates to [-128, 127] (PTX clamps float-to-integer results to the destination's range)
    and turns NaN into 0 (its rule for NaN inputs), where rounding by adding 1.5 * 2**23, two
    clamps and the NaN select take 6 instructions an element (and the clamps, hardware
    min/max, would drop a NaN)."""
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
def _mix32(h):
    """murmur3's finalizer on uint32 (wrapping), as formats.rounding_hash._mix32."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B).to(tl.uint32)
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35).to(tl.uint32)
    return h ^ (h >> 16)


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
def _store_master(p, p_ptrs, c_ptrs, mask, offs, seed, step, MASTER: tl.constexpr):
    """Write float32 masters `p` as bfloat16 weights (+ corrections), as formats.master_weights."""
    bits = p.to(tl.int32, bitcast=True)
    if MASTER == 32:
        high = (bits + 0x8000) >> 16  # to nearest, ties away from zero
        tl.store(c_ptrs, (bits - (high << 16)).to(tl.int16), mask=mask)
    elif MASTER == 24:
        if FAST_MATH:
            # the GPU's conversion (cvt.rn.bf16x2.f32: two elements an instruction, where the
            # integer rounding below takes 4 an element and the store's NaN select 2 more) rounds
            # to nearest even as that integer rounding does at every non-NaN p: bfloat16 keeps
            # float32's exponent field, so rounding the pattern's low 16 bits is IEEE rounding,
            # subnormals, carries into the exponent and overflow to Inf included; a NaN stays a
            # NaN, as the store below keeps it (its c is NaN, stored as 0, either way)
            wb = _to_bf16(p)
            w = wb.to(tl.float32)
            wbits = w.to(tl.int32, bitcast=True)
        else:
            high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even
            wbits = high << 16
            w = wbits.to(tl.float32, bitcast=True)
        # 1 / s: exponent fields add to 254 (s is a normal power of two, 2**-126 at least)
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
def _adamw_kernel(
    p_base,
    g_base,
    m_base,
    v_base,
    x_base,
    c_base,
    table_ptr,
    meta_ptr,
    blocks_ptr,
    hyper_ptr,
    scalars_ptr,
    found_inf_ptr,
    grad_scale_ptr,
    nonfinite_ptr,
    COMPRESSED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    GROUP: tl.constexpr,
    GPP: tl.constexpr,
    EVEN: tl.constexpr,
    MASTER: tl.constexpr,
    M_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
):
    if HAS_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
    local_block = tl.load(blocks_ptr + 2 * pid + 1)
    row_ptr = table_ptr + t * 13
    cols = tl.load(meta_ptr + 5 * t)  # (META columns)
    groups_per_row = tl.load(meta_ptr + 5 * t + 1)
    n_groups = tl.load(meta_ptr + 5 * t + 2)

    gid = local_block.to(tl.int64) * GPP + tl.arange(0, GPP)
    gmask = gid < n_groups
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    if M_FMT.FP4 + V_FMT.FP4 > 0:  # byte offsets of packed 4-bit codes (the same groups)
        poffs, pmask = packed_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    else:
        poffs, pmask = offs, mask

    # per-launch hyperparameters and per-tensor step size / bias correction (see _scalars)
    decay = tl.load(hyper_ptr)
    w1 = tl.load(hyper_ptr + 1)
    b2 = tl.load(hyper_ptr + 2)
    w2 = tl.load(hyper_ptr + 3)
    eps = tl.load(hyper_ptr + 4)
    step_size = tl.load(scalars_ptr + 2 * t)
    inv_bc2_sqrt = tl.load(scalars_ptr + 2 * t + 1)

    p_ptrs = _data(p_base, row_ptr, 0, offs)
    if MASTER > 0:
        c_ptrs = _data(c_base, row_ptr, 12, offs)
        p = _load_master(tl.load(p_ptrs, mask=mask, other=0.0), c_ptrs, mask, MASTER)
    else:
        c_ptrs = p_ptrs
        p = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(_data(g_base, row_ptr, 1, offs), mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    # a 4-bit moment's pointers serve its load and its store (the table reads and 64-bit adds
    # are not repeated)
    if COMPRESSED and M_FMT.FP4 > 0:
        m_codes = _packed(m_base, row_ptr, 2, poffs, EVEN)
        m_scales = _group_pointers(row_ptr, 2, gid, False)[0]
        m = load_decode4(m_codes, pmask, m_scales, gmask, mask, GROUP, M_FMT.FP4, EVEN)
    else:
        m = _load_moment(m_base, row_ptr, 2, offs, mask, gid, gmask, poffs, pmask, COMPRESSED, M_FMT,
                         GROUP, EVEN)  # fmt: skip
    if COMPRESSED and V_FMT.FP4 > 0:
        v_codes = _packed(v_base, row_ptr, 5, poffs, EVEN)
        v_scales = _group_pointers(row_ptr, 5, gid, False)[0]
        v = load_decode4(v_codes, pmask, v_scales, gmask, mask, GROUP, V_FMT.FP4, EVEN)
    else:
        v = _load_moment(v_base, row_ptr, 5, offs, mask, gid, gmask, poffs, pmask, COMPRESSED, V_FMT,
                         GROUP, EVEN)  # fmt: skip
    # a second moment's NaN code reads as +Inf (formats.optimizer_state.SECOND_MOMENTS; a 4-bit
    # one's decoder does it per group)
    if COMPRESSED and V_FMT.FP4 == 0:
        v = tl.where(v != v, float("inf"), v)

    p = p * decay
    if w1 < 0.5:  # torch.lerp's two formulas
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = v * b2 + w2 * g * g
    if AMSGRAD:
        vmax = _load_moment(x_base, row_ptr, 8, offs, mask, gid, gmask, poffs, pmask, COMPRESSED,
                            V_FMT, GROUP, EVEN)  # fmt: skip
        if COMPRESSED and V_FMT.FP4 == 0:
            vmax = tl.where(vmax != vmax, float("inf"), vmax)
        vmax = tl.maximum(vmax, v)
        denom = tl.sqrt(vmax) * inv_bc2_sqrt + eps
    else:
        denom = tl.sqrt(v) * inv_bc2_sqrt + eps
    p = p - step_size * fast_divide(m, denom)  # approximate division: 2 ulp

    # stochastic roundings hash (seed, step, element offset in the global tensor)
    SR_V: tl.constexpr = COMPRESSED and V_FMT.FP4 == 2  # ue3m1_sqrt
    if MASTER == 16 or SR_V:
        seed = tl.load(meta_ptr + 5 * t + 3).to(tl.uint32)
        step = tl.load(tl.load(row_ptr + 11).to(tl.pointer_type(tl.float32)))
        first = tl.load(meta_ptr + 5 * t + 4)
        goffs = offs + first
    else:
        seed = 0
        step = 0.0
        goffs = offs
    if SR_V:
        rbits = _rounding_bits(seed, step, gid, goffs, first, GROUP, EVEN)
    else:
        rbits = 0
    if MASTER > 0:
        _store_master(p, p_ptrs, c_ptrs, mask, goffs, seed, step, MASTER)
    else:
        tl.store(p_ptrs, p.to(p_base.dtype.element_ty), mask=mask)
    if COMPRESSED and M_FMT.FP4 > 0 and V_FMT.FP4 > 0:
        # both 4-bit: one program-wide reduction decides both encoders' exact path and the
        # count (a reduction across warps is a shared-memory round trip with two barriers)
        m_mag, m_sign, m_mx = magnitudes4(m, M_FMT.FP4)
        v_mag, v_sign, v_mx = magnitudes4(v, V_FMT.FP4)
        flag = rare_groups4(m_mx, M_FMT.FP4) | rare_groups4(v_mx, V_FMT.FP4)
        rare = tl.max(flag.to(tl.int32), axis=0) > 0
        quantize_store4(m, m_mag, m_sign, m_mx, rare, m_codes, pmask, m_scales, gmask, GROUP, M_FMT.FP4, EVEN,
                        0, False)  # fmt: skip
        quantize_store4(v, v_mag, v_sign, v_mx, rare, v_codes, pmask, v_scales, gmask, GROUP, V_FMT.FP4, EVEN,
                        rbits, SR_V)  # fmt: skip
        if rare:  # rare (it holds wherever m + v is not finite)
            _count_nonfinite(m, v, row_ptr, nonfinite_ptr, t, False)
    else:
        if COMPRESSED and M_FMT.FP4 > 0:
            encode_store4(m, m_codes, pmask, m_scales, gmask, GROUP, M_FMT.FP4, EVEN, 0, False)
        else:
            _store_moment(m, m_base, row_ptr, 2, offs, mask, gid, gmask, COMPRESSED, M_FMT, poffs, pmask,
                          GROUP, EVEN, 0, False)  # fmt: skip
        if COMPRESSED and V_FMT.FP4 > 0:
            encode_store4(v, v_codes, pmask, v_scales, gmask, GROUP, V_FMT.FP4, EVEN, rbits, SR_V)
        else:
            _store_moment(v, v_base, row_ptr, 5, offs, mask, gid, gmask, COMPRESSED, V_FMT, poffs, pmask,
                          GROUP, EVEN, 0, False)  # fmt: skip
        _count_nonfinite(m, v, row_ptr, nonfinite_ptr, t, M_FMT.FP4 + V_FMT.FP4 == 0)
    if AMSGRAD:  # (the running maximum of v, in v's format)
        _store_moment(vmax, x_base, row_ptr, 8, offs, mask, gid, gmask, COMPRESSED, V_FMT, poffs, pmask,
                      GROUP, EVEN, 0, False)  # fmt: skip


def format_constexprs(fm: MomentFormat | None, fv: MomentFormat | None) -> dict:
    """The kernel's M_FMT and V_FMT for moments stored in `fm` (exp_avg) and `fv` (the others)."""
    return {"M_FMT": moment_format(fm), "V_FMT": moment_format(fv)}
