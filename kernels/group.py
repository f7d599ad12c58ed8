"""Triton FP8 group codec: quantize / dequantize a tensor in the group format.

Twin: coatstate.formats.quantize / dequantize. Plain mode is bit-exact against it (the rounding
is done in float32 before the cast, see kernels/fp8_triton.py); with expansion the codes may
differ by one FP8 step (GPU log2/exp2 approximations), the values stay within the error bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.defaults import EXPAND, FORMAT, GROUP_SIZE
from ..formats.fp8 import FLOAT_DTYPES, FP8Format
from ..formats.group import GroupQuantized, group_layout
from .fp8_triton import encode_store, group_format, group_offsets, load_decode

GROUPS_PER_PROGRAM = 8


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    exps_ptr,
    n_groups,
    cols,
    groups_per_row,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    GPP: tl.constexpr,
    EVEN: tl.constexpr,
):
    gid = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    encode_store(x, codes_ptr + offs, scales_ptr + gid, exps_ptr + gid, mask, gid < n_groups, FMT)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    exps_ptr,
    out_ptr,
    n_groups,
    cols,
    groups_per_row,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    GPP: tl.constexpr,
    EVEN: tl.constexpr,
):
    gid = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)
    x = load_decode(codes_ptr + offs, scales_ptr + gid, exps_ptr + gid, mask, gid < n_groups, FMT)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check_group_size(group_size: int) -> None:
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(
            f"the Triton codec needs a power-of-two group_size >= 2; got {group_size}. "
            "Use coatstate.formats.quantize (pure torch) for other sizes"
        )


def quantize(
    x: torch.Tensor, *, group_size: int = GROUP_SIZE, fmt: FP8Format | str = FORMAT, expand: bool = EXPAND
) -> GroupQuantized:
    """Triton twin of coatstate.formats.quantize (no finiteness check: it would synchronise)."""
    fmt = FP8Format.parse(fmt)
    _check_group_size(group_size)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 tensors; got {x.dtype}")
    x = x.contiguous()
    rows, cols, groups = group_layout(x.shape, group_size)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    exps = torch.empty((rows, groups), dtype=torch.uint8, device=x.device) if expand else scales
    n_groups = rows * groups
    if n_groups and x.numel():
        grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
        _quantize_kernel[grid](
            x,
            codes,
            scales,
            exps,
            n_groups,
            cols,
            groups,
            FMT=group_format(fmt, expand),
            GROUP=group_size,
            GPP=GROUPS_PER_PROGRAM,
            EVEN=cols % group_size == 0,
        )
    elif n_groups:
        scales.zero_()
        if expand:
            exps.fill_(16)
    return GroupQuantized(codes.view(fmt.dtype), scales, exps if expand else None, group_size)


def dequantize(q: GroupQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of coatstate.formats.dequantize."""
    _check_group_size(q.group_size)
    rows, cols, groups = group_layout(q.shape, q.group_size)
    out = torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    n_groups = rows * groups
    if n_groups and out.numel():
        codes = q.codes.contiguous().view(torch.uint8)
        exps = q.exponents if q.exponents is not None else q.scales
        grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
        _dequantize_kernel[grid](
            codes,
            q.scales.contiguous(),
            exps.contiguous(),
            out,
            n_groups,
            cols,
            groups,
            FMT=group_format(q.fmt, q.expanded),
            GROUP=q.group_size,
            GPP=GROUPS_PER_PROGRAM,
            EVEN=cols % q.group_size == 0,
        )
    return out
