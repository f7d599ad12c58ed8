"""Triton kernels that pack saved activations into FP8 and unpack them for backward.

Twins (the CPU path and the oracle): coatstate.formats.tensorwise.

Per-tensor scaling, three launches, two passes over the data:
  1. `_partial_amax_kernel`: one max|x| per block of AMAX_BLOCK elements (first stage);
  2. `_tensor_scale_kernel`: one program reduces those (second stage) and writes
     [scale, 1/scale] (float32, correctly rounded divisions);
  3. `_pack_tensor_kernel`: codes = fp8(round(x * (1/scale))).
No host sync anywhere: the scale stays on the device.

Per-group scaling: rows are over the LAST dim of the activation (x viewed as (numel / last,
last)), each row cut into groups of G elements, the last group of a row possibly shorter; a
group never crosses a row, so a group never mixes two tokens. (The optimizer's layout in
formats.group uses rows = dim 0; for activations the feature dim is the natural row.) One pass:
each program loads a (BLOCK_M, BLOCK_N) tile, views it as (BLOCK_M, BLOCK_N / G, G), takes the
group maxima, and writes codes and float32 scales of shape (rows, groups_per_row).

Bit-exactness with the twin (also under TRITON_INTERPRET=1): the maximum is exact in any order;
scale and reciprocal use `tl.div_rn` (IEEE division, as torch's); x * inv is one float32
multiply; `fp8_triton.round_to_fp8_grid` puts the value on the FP8 grid with float32 adds that round to
nearest even (as formats.fp8.round_to_fp8_grid does), so the final cast to float8 is exact
(the interpreter's own float32 -> float8 cast does not round to nearest even, see NOTES.md);
unpacking is one float32 multiply, then (for bfloat16 outputs) an integer round to nearest
even onto the bfloat16 grid, then an exact cast. FMA contraction is switched off at launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ..formats.fp8 import FP8Format
from ..formats.group import MIN_SCALE
from ..formats.tensorwise import AMAX_BLOCK
from .fp8_triton import round_to_fp8_grid

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE = 4096  # elements per program in the per-group kernels
_SCALE_BLOCK = 1024


@triton.jit
def _round_to_bf16(x):
    """Round float32 x to the nearest bfloat16 (ties to even) in integer arithmetic, so the cast
    to bfloat16 that follows is exact (the interpreter's own cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _partial_amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _tensor_scale_kernel(partial_ptr, scale_ptr, n_partial, fp8_max, min_scale, BLOCK: tl.constexpr):
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
def _pack_tensor_kernel(
    x_ptr, scale_ptr, codes_ptr, n,
    FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    inv = tl.load(scale_ptr + 1)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = round_to_fp8_grid(x * inv, FP8_MAX, MANT, EMIN)
    tl.store(codes_ptr + offs, q.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unpack_tensor_kernel(codes_ptr, scale_ptr, out_ptr, n, BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_ptr)
    q = tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = q * scale
    if BF16:
        x = _round_to_bf16(x)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_tile(rows, cols, groups_per_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile: element offsets and mask, and the offsets and mask
    of its [BLOCK_M, BLOCK_N // G] group scales."""
    GROUPS: tl.constexpr = BLOCK_N // G
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    smask = (r[:, None] < rows) & (g[None, :] < groups_per_row)
    return r[:, None] * cols + c[None, :], mask, r[:, None] * groups_per_row + g[None, :], smask


@triton.jit
def _pack_groups_kernel(
    x_ptr, codes_ptr, scales_ptr, rows, cols, groups_per_row, fp8_max, min_scale,
    FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_N // G
    offs, mask, soffs, smask = _group_tile(rows, cols, groups_per_row, BLOCK_M, BLOCK_N, G)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, [BLOCK_M, GROUPS, G])
    amax = tl.max(tl.abs(x3), axis=2)
    scale = tl.maximum(tl.div_rn(amax, fp8_max), min_scale)
    scale = tl.where(amax > 0, scale, 0.0)
    safe = tl.where(scale > 0, scale, 1.0)
    inv = tl.where(scale > 0, tl.div_rn(tl.full([BLOCK_M, GROUPS], 1.0, tl.float32), safe), 0.0)
    q = round_to_fp8_grid(x3 * inv[:, :, None], FP8_MAX, MANT, EMIN)
    q = tl.reshape(q, [BLOCK_M, BLOCK_N])
    tl.store(codes_ptr + offs, q.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + soffs, scale, mask=smask)


@triton.jit
def _unpack_groups_kernel(
    codes_ptr, scales_ptr, out_ptr, rows, cols, groups_per_row, BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_N // G
    offs, mask, soffs, smask = _group_tile(rows, cols, groups_per_row, BLOCK_M, BLOCK_N, G)
    q = tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + soffs, mask=smask, other=0.0)
    x = tl.reshape(tl.reshape(q, [BLOCK_M, GROUPS, G]) * scale[:, :, None], [BLOCK_M, BLOCK_N])
    if BF16:
        x = _round_to_bf16(x)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check_input(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16; got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {x.stride()}")


def _check_codes(name: str, codes: torch.Tensor) -> FP8Format:
    if not codes.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {codes.stride()}")
    return FP8Format.parse(codes.dtype)  # raises for a non-FP8 dtype


def _launch_options() -> dict:
    return {"enable_fp_fusion": False}


def pack_tensorwise(x: torch.Tensor, fmt: FP8Format | str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, float32 [scale, 1/scale]) with one scale for the whole tensor."""
    _check_input("x", x)
    fmt = FP8Format.parse(fmt)
    n = x.numel()
    codes = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    n_partial = max(1, triton.cdiv(n, AMAX_BLOCK))
    partial = torch.empty(n_partial, dtype=torch.float32, device=x.device)
    scale = torch.empty(2, dtype=torch.float32, device=x.device)
    _partial_amax_kernel[(n_partial,)](x, partial, n, BLOCK=AMAX_BLOCK, **_launch_options())
    _tensor_scale_kernel[(1,)](partial, scale, n_partial, fmt.max, MIN_SCALE, BLOCK=_SCALE_BLOCK,
                               **_launch_options())
    _pack_tensor_kernel[(n_partial,)](
        x, scale, codes, n, FP8_MAX=fmt.max, MANT=fmt.mantissa_bits, EMIN=fmt.min_normal_exponent,
        BLOCK=AMAX_BLOCK, **_launch_options(),
    )
    return codes, scale


def unpack_tensorwise(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale[0] in `dtype` (scale as returned by pack_tensorwise, or a 1-element tensor)."""
    _check_codes("codes", codes)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    n = codes.numel()
    grid = (max(1, triton.cdiv(n, AMAX_BLOCK)),)
    _unpack_tensor_kernel[grid](
        codes, scale.float(), out, n, BF16=dtype == torch.bfloat16, BLOCK=AMAX_BLOCK, **_launch_options()
    )
    return out


def _group_tiles(cols: int, group_size: int) -> tuple[int, int]:
    if group_size < 1 or group_size & (group_size - 1) or group_size > 1024:
        raise ValueError(f"group_size must be a power of two in [1, 1024] for the kernel; got {group_size}")
    block_n = max(group_size, min(triton.next_power_of_2(max(cols, 1)), 1024))
    return max(1, _TILE // block_n), block_n


def pack_groups(x2d: torch.Tensor, group_size: int = 16, fmt: FP8Format | str = "e4m3"):
    """(codes (rows, cols), float32 scales (rows, groups_per_row)) of a contiguous 2-D tensor."""
    _check_input("x2d", x2d)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D (rows, row_length); got shape {tuple(x2d.shape)}")
    fmt = FP8Format.parse(fmt)
    rows, cols = x2d.shape
    block_m, block_n = _group_tiles(cols, group_size)
    groups = max(1, triton.cdiv(cols, group_size))
    codes = torch.empty(x2d.shape, dtype=fmt.dtype, device=x2d.device)
    scales = torch.zeros(rows, groups, dtype=torch.float32, device=x2d.device)
    if rows and cols:
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
        _pack_groups_kernel[grid](
            x2d, codes, scales, rows, cols, groups, fmt.max, MIN_SCALE,
            FP8_MAX=fmt.max, MANT=fmt.mantissa_bits, EMIN=fmt.min_normal_exponent,
            BLOCK_M=block_m, BLOCK_N=block_n, G=group_size, **_launch_options(),
        )
    return codes, scales


def unpack_groups(codes2d: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype):
    """The float tensor (rows, cols) in `dtype` from pack_groups' codes and scales."""
    _check_codes("codes2d", codes2d)
    if codes2d.dim() != 2:
        raise ValueError(f"codes2d must be 2-D; got shape {tuple(codes2d.shape)}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    rows, cols = codes2d.shape
    block_m, block_n = _group_tiles(cols, group_size)
    groups = max(1, triton.cdiv(cols, group_size))
    if tuple(scales.shape) != (rows, groups) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(
            f"scales must be contiguous float32 of shape {(rows, groups)}; got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    out = torch.empty(codes2d.shape, dtype=dtype, device=codes2d.device)
    if rows and cols:
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
        _unpack_groups_kernel[grid](
            codes2d, scales, out, rows, cols, groups, BF16=dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_N=block_n, G=group_size, **_launch_options(),
        )
    return out
