"""coatstate's kernels as torch custom ops, so torch.compile and fake tensors trace through them.

    torch.ops.coatstate.group_quantize(x, group_size, fmt, expand) -> (codes, scales, exponents)
    torch.ops.coatstate.group_dequantize(codes, scales, exponents, group_size, fmt, dtype) -> x
    torch.ops.coatstate.fused_adamw_(...)   (kernels/adamw_launch.py: the whole optimizer step)

Each runs the Triton kernel on CUDA and the pure-torch twin elsewhere (fused_adamw_ also runs
its kernel under Triton's interpreter when TRITON_INTERPRET=1). Codes travel as uint8 bit
patterns (`.view(torch.float8_e4m3fn)` gives the FP8 values; torch has few float8 ops for
tracing tools to use); `exponents` is an empty uint8 tensor when expansion is off (an op returns
tensors, never None).
"""

from __future__ import annotations

import torch

from ..formats import group as _twin
from ..formats.fp8 import FP8Format
from ..formats.group import GroupQuantized, group_layout
from . import adamw_launch
from . import group as codec
from .runtime import triton_usable

fused_adamw_ = adamw_launch.fused_adamw_


def _no_exponents(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


@torch.library.custom_op("coatstate::group_quantize", mutates_args=())
def group_quantize(
    x: torch.Tensor, group_size: int, fmt: str, expand: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x in the FP8 group format (docs/FORMAT.md). Non-finite inputs are not checked (that would
    synchronise): they give NaN codes, as the fused step's inputs do."""
    if triton_usable(x.device):
        q = codec.quantize(x, group_size=group_size, fmt=fmt, expand=expand)
    else:
        rows, cols, _ = group_layout(x.shape, group_size)
        codes, scales, exps = _twin.quantize_groups(
            x.reshape(rows, cols), group_size, FP8Format.parse(fmt), expand
        )
        q = GroupQuantized(codes.contiguous().reshape(x.shape), scales, exps, group_size)
    exps = q.exponents if q.exponents is not None else _no_exponents(x.device)
    return q.codes.view(torch.uint8), q.scales, exps


@group_quantize.register_fake
def _(x, group_size, fmt, expand):
    rows, _, groups = group_layout(x.shape, group_size)
    FP8Format.parse(fmt)  # the real op's error for an unknown format
    codes = x.new_empty(x.shape, dtype=torch.uint8)
    scales = x.new_empty((rows, groups), dtype=torch.float32)
    exps = x.new_empty((rows, groups) if expand else (0,), dtype=torch.uint8)
    return codes, scales, exps


@torch.library.custom_op("coatstate::group_dequantize", mutates_args=())
def group_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    exponents: torch.Tensor,
    group_size: int,
    fmt: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The values of a tensor in the FP8 group format, as `dtype`."""
    codes = codes.view(FP8Format.parse(fmt).dtype)
    q = GroupQuantized(codes, scales, exponents if exponents.numel() else None, group_size)
    if triton_usable(codes.device):
        return codec.dequantize(q, dtype)
    return _twin.dequantize(q, dtype).contiguous()


@group_dequantize.register_fake
def _(codes, scales, exponents, group_size, fmt, dtype):
    return codes.new_empty(codes.shape, dtype=dtype)
