"""Triton kernels for FP8Linear's GEMM operands: per-tensor FP8 with a float32 scale.

Twin (the CPU path and the oracle): coatstate.formats.tensorwise (s = amax / FP8_MAX from a
two-stage maximum, correctly rounded divisions), which these kernels match bit for bit. Not the
saved-activation format (kernels/activation.py): torch._scaled_mm takes any float32 scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.fp8 import FLOAT_DTYPES, FP8Format
from ..formats.group import MIN_SCALE
from ..formats.tensorwise import AMAX_BLOCK
from .fp8_triton import cdiv, check_float_input, round_to_fp8_grid


@triton.jit
def _gemm_round_to_bf16(x):
    """Round float32 x to the nearest bfloat16 (ties to even) in integer arithmetic, so the cast
    to bfloat16 that follows is exact (the interpreter's own cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gemm_partial_amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _gemm_scale_kernel(partial_ptr, scale_ptr, n_partial, fp8_max, min_scale, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_partial, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(partial_ptr + offs, mask=offs < n_partial, other=0.0))
    amax = tl.max(acc, axis=0)
    scale = tl.maximum(tl.div_rn(amax, fp8_max), min_scale)
    scale = tl.where(amax > 0, scale, 0.0)
    safe = tl.where(scale > 0, scale, 1.0)
    inv = tl.where(scale > 0, tl.div_rn(1.0, safe), 0.0)
    tl.store(scale_ptr, scale)
    tl.store(scale_ptr + 1, inv)


@triton.jit
def _gemm_pack_kernel(
    x_ptr,
    scale_ptr,
    codes_ptr,
    n,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    inv = tl.load(scale_ptr + 1)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = round_to_fp8_grid(x * inv, FP8_MAX, MANT, EMIN)
    tl.store(codes_ptr + offs, q.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_unpack_kernel(codes_ptr, scale_ptr, out_ptr, n, BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_ptr)
    q = tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = q * scale
    if BF16:
        x = _gemm_round_to_bf16(x)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_options() -> dict:
    return {"enable_fp_fusion": False}


def pack_tensorwise(x: torch.Tensor, fmt: FP8Format | str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, float32 [scale, 1/scale]) with one scale for the whole tensor."""
    check_float_input("x", x)
    fmt = FP8Format.parse(fmt)
    n = x.numel()
    codes = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    n_partial = max(1, cdiv(n, AMAX_BLOCK))
    partial = torch.empty(n_partial, dtype=torch.float32, device=x.device)
    scale = torch.empty(2, dtype=torch.float32, device=x.device)
    _gemm_partial_amax_kernel[(n_partial,)](x, partial, n, BLOCK=AMAX_BLOCK, **_launch_options())
    _gemm_scale_kernel[(1,)](partial, scale, n_partial, fmt.max, MIN_SCALE, BLOCK=1024, **_launch_options())
    _gemm_pack_kernel[(n_partial,)](
        x,
        scale,
        codes,
        n,
        FP8_MAX=fmt.max,
        MANT=fmt.mantissa_bits,
        EMIN=fmt.min_normal_exponent,
        BLOCK=AMAX_BLOCK,
        **_launch_options(),
    )
    return codes, scale


def unpack_tensorwise(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale[0] in `dtype` (scale as returned by pack_tensorwise, or a 1-element tensor)."""
    FP8Format.parse(codes.dtype)  # raises for a non-FP8 dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    n = codes.numel()
    grid = (max(1, cdiv(n, AMAX_BLOCK)),)
    _gemm_unpack_kernel[grid](
        codes, scale.float(), out, n, BF16=dtype == torch.bfloat16, BLOCK=AMAX_BLOCK, **_launch_options()
    )
    return out
