"""The fused momentum steps of CompressedSGD, CompressedLion and CompressedMuon in Triton.

One pass per element: read the gradient, the parameter and the momentum's codes with their group
scale (and exponent), update in float32 registers in the reference's order, write the parameter
(SGD, Lion) or the update Newton-Schulz takes (Muon), and the momentum's new codes and group
scales. Every `x.add(y, alpha=a)` of the twin is torch's single rounding, fma(y, a, x), so the
kernel spells it tl.fma; a lerp is torch's two-formula lerp, also one fma. One launch a
parameter.

Twin: coatstate.optim.momentum_step (the CPU path and the oracle). Plain FP8 and 4-bit codes
equal the twin's bit for bit (both round in float32 before the cast: NOTES.md); with range
expansion log2/exp2 may move a code by one FP8 step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.fp4_moment import FP4Format
from ..formats.group import group_layout
from ..formats.optimizer_state import CODES, EXPONENTS, SCALES, MomentFormat, init_moment, is_compressed
from .fp4_triton import encode_store4, load_decode4, moment_format, packed_offsets
from .fp8_triton import encode_store, group_offsets, load_decode
from .runtime import interpreting

SGD, LION, MUON = 0, 1, 2
"""the KIND constexpr"""
GROUPS_PER_PROGRAM = 4
INTERPRETER_GROUPS_PER_PROGRAM = 64
"""under Triton's CPU interpreter each program costs host time: fewer, larger programs"""


@triton.jit
def _lerp(a, b, w, w_minus_1):
    """torch.lerp(a, b, w) for a scalar weight, as torch's vectorised CPU kernel: one fma.
    w - 1 comes from the host, rounded in float32 as torch does (the interpreter would compute
    it from a scalar argument in float64)."""
    d = b - a
    if w < 0.5:
        return tl.fma(d, w, a)
    else:
        return tl.fma(d, w_minus_1, b)


@triton.jit
def _momentum_kernel(p_ptr, g_ptr, u_ptr, m_ptr, s_ptr, e_ptr, nonfinite_ptr, n_groups, cols, groups_per_row,
                     h0, h1, h2, h3, h4, h5, KIND: tl.constexpr, FIRST: tl.constexpr,
                     NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
                     COMPRESSED: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                     EVEN: tl.constexpr):  # fmt: skip
    """h0..h5 per KIND (the launchers' `hyper`): SGD (-lr, momentum, 1 - dampening,
    weight_decay); LION (-lr, 1 - lr * weight_decay, b1, 1 - b1, b2, 1 - b2); MUON (w, w - 1 for
    w = 1 - momentum, then for w = momentum). The momentum: float32 (not COMPRESSED), FP8 codes
    (uint8) with group scales and exponents, or packed 4-bit codes (FMT.FP4) with group scales."""
    gid = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    gmask = gid < n_groups
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    if FMT.FP4 > 0:
        poffs, pmask = packed_offsets(gid, n_groups, cols, groups_per_row, GROUP, False)
    if FIRST:  # (SGD's first step: the buffer is the gradient; no codes to read)
        m = tl.zeros(offs.shape, tl.float32)
    elif not COMPRESSED:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    elif FMT.FP4 > 0:
        m = load_decode4(m_ptr + poffs, pmask, s_ptr + gid, gmask, mask, GROUP, FMT.FP4, False)
    else:
        m = load_decode(m_ptr + offs, s_ptr + gid, e_ptr + gid, mask, gmask, FMT)
    if KIND == 0:  # SGD
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        if HAS_WD:
            g = tl.fma(p, h3, g)
        if FIRST:
            m = g
        else:
            m = tl.fma(g, h2, m * h1)
        if NESTEROV:
            d = tl.fma(m, h1, g)
        else:
            d = m
        tl.store(p_ptr + offs, tl.fma(d, h0, p), mask=mask)
    elif KIND == 1:  # Lion
        p = tl.load(p_ptr + offs, mask=mask, other=0.0) * h1
        c = tl.fma(g, h3, m * h2)
        s = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))  # torch.sign (NaN -> 0 on the CPU)
        tl.store(p_ptr + offs, tl.fma(s, h0, p), mask=mask)
        m = tl.fma(g, h5, m * h4)
    else:  # Muon's momentum accumulation
        m = _lerp(m, g, h0, h1)
        if NESTEROV:
            tl.store(u_ptr + offs, _lerp(g, m, h2, h3), mask=mask)
        else:
            tl.store(u_ptr + offs, m, mask=mask)
    if not COMPRESSED:
        tl.store(m_ptr + offs, m, mask=mask)
    elif FMT.FP4 > 0:  # (the encoder wants exact zeros off the mask)
        m4 = tl.where(mask, m, 0.0)
        encode_store4(m4, m_ptr + poffs, pmask, s_ptr + gid, gmask, GROUP, FMT.FP4, False, 0, False)
    else:
        encode_store(m, m_ptr + offs, s_ptr + gid, e_ptr + gid, mask, gmask, FMT)
    bad = tl.sum(tl.sum(((m - m != 0) & mask).to(tl.int32), axis=1), axis=0)
    if bad > 0:  # rare: a NaN/Inf gradient, reported by nonfinite_parameters()
        tl.atomic_add(nonfinite_ptr, bad)


def launchable(fmt: MomentFormat | None) -> bool:
    """Whether the kernel takes a momentum in `fmt`: Triton tiles are powers of two (other group
    sizes take the twin)."""
    g = fmt.group_size if fmt is not None else 128
    return g >= 2 and g & (g - 1) == 0 and (fmt is None or fmt.bits == 8 or g >= 4)


def _launch(kind: int, param: torch.Tensor, grad: torch.Tensor, state: dict, name: str,
            fmt: MomentFormat | None, hyper: tuple, update: torch.Tensor | None = None,
            **flags) -> torch.Tensor:  # fmt: skip
    """Run the kernel on one parameter; creates the momentum on its first step (SGD's from the
    gradient, the others' from zeros). Returns the count of non-finite momentum values (a
    one-element tensor, never synchronised here)."""
    first = name not in state and not is_compressed(state, name)
    if first:
        init_moment(state, name, grad, fmt)
    group_size = fmt.group_size if fmt is not None else 128
    rows, cols, groups = group_layout(tuple(grad.shape), group_size)
    if fmt is None:
        m = scales = exps = state[name]
    else:
        m, scales = state[name + CODES], state[name + SCALES]
        m = m.view(torch.uint8) if fmt.bits == 8 else m
        exps = state.get(name + EXPONENTS, scales)
    four = fmt is not None and isinstance(fmt.fmt, FP4Format)
    options = dict(NESTEROV=False, MAXIMIZE=False, HAS_WD=False)
    options.update(flags, KIND=kind, FIRST=first and kind == SGD, COMPRESSED=fmt is not None)
    options.update(FMT=moment_format(fmt), GROUP=group_size, EVEN=not four and cols % group_size == 0)
    nonfinite = torch.zeros(1, dtype=torch.int32, device=grad.device)
    n_groups = rows * groups
    gpp = INTERPRETER_GROUPS_PER_PROGRAM if interpreting() else GROUPS_PER_PROGRAM
    if n_groups and grad.numel():
        pointers = (param, grad, update if update is not None else grad, m, scales, exps, nonfinite)
        scalars = (n_groups, cols, groups, *hyper, *(0.0,) * (6 - len(hyper)))
        _momentum_kernel[(triton.cdiv(n_groups, gpp),)](*pointers, *scalars, GPP=gpp, **options)
    return nonfinite[0]


def _weight(w: float) -> tuple[float, float]:
    """(w, w - 1) as torch's lerp computes them: w rounded to float32, then w - 1 in float32."""
    w32 = torch.tensor(w, dtype=torch.float32)
    return w32.item(), (w32 - 1).item()


def sgd_fused(param, grad, state, fmt, *, lr, momentum, dampening, nesterov, weight_decay, maximize):
    """coatstate.optim.momentum_step.sgd_step in one pass (momentum != 0; `launchable(fmt)`)."""
    hyper = (-float(lr), momentum, 1 - dampening, float(weight_decay))
    return _launch(
        SGD,
        param,
        grad.contiguous(),
        state,
        "momentum_buffer",
        fmt,
        hyper,
        NESTEROV=nesterov,
        MAXIMIZE=maximize,
        HAS_WD=weight_decay != 0,
    )


def lion_fused(param, grad, state, fmt, *, lr, betas, weight_decay, maximize):
    """coatstate.optim.momentum_step.lion_step in one pass (`launchable(fmt)`)."""
    lr = float(lr)
    b1, b2 = betas
    hyper = (-lr, 1 - lr * weight_decay, b1, 1 - b1, b2, 1 - b2)
    return _launch(LION, param, grad.contiguous(), state, "exp_avg", fmt, hyper, MAXIMIZE=maximize)


def muon_accumulate_fused(state, grad, fmt, momentum, nesterov):
    """coatstate.optim.momentum_step.muon_momentum in one pass (`launchable(fmt)`): (update,
    non-finite count)."""
    update = torch.empty_like(grad, dtype=torch.float32)
    hyper = (*_weight(1 - momentum), *_weight(momentum))
    bad = _launch(
        MUON, grad, grad.contiguous(), state, "momentum_buffer", fmt, hyper, update=update, NESTEROV=nesterov
    )
    return update, bad
