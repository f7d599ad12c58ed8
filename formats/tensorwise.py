"""FP8 codecs for saved activations: one scale per tensor, or one per group of 16 along rows.

The pure-torch twins of kernels/activation_pack.py; they are the CPU path and the oracle.

Per-tensor (COAT's scaling of linear-layer inputs): amax = max|x| taken in two stages, first one
maximum per block of `AMAX_BLOCK` consecutive elements (the flat order), then the maximum of
those. A maximum is exact, so the two-stage order gives the same amax as any other order; it is
spelled out here because the kernel does it that way. Then, in float32:

    s = max(amax / FP8_MAX, MIN_SCALE)   (0 when amax == 0)
    inv = 1 / s                           (0 when s == 0)
    q = fp8(round_to_fp8_grid(x * inv))

Per-group along rows (COAT's scaling of norm and activation-function inputs): the tensor is
viewed as rows of `row_length` elements (for activations the LAST dim, see `row_view`) and each
row is cut into groups of `group_size`; formats.group.quantize_groups does the work with
expansion off, so the scales are float32 of shape (rows, groups_per_row).

Every division is a correctly rounded float32 division and the rounding onto the FP8 grid is
done in float32 before the cast, so the Triton kernels (which use `div_rn` and the same
rounding) agree with these functions bit for bit, also in Triton's interpreter.

Non-finite inputs are not checked (that would cost a device sync per saved tensor): a NaN or
Inf gives NaN after the round trip, so it shows up in the gradients instead of being hidden.
"""

from __future__ import annotations

import torch

from .fp8 import FP8Format, round_to_fp8_grid
from .group import MIN_SCALE, dequantize_groups, quantize_groups

AMAX_BLOCK = 4096
"""Elements per first-stage block of the two-stage per-tensor maximum (the kernel's block)."""


def partial_amax(x: torch.Tensor, block: int = AMAX_BLOCK) -> torch.Tensor:
    """First stage: float32 max|x| of each block of `block` consecutive elements (flat order)."""
    flat = x.reshape(-1)
    blocks = max(1, -(-flat.numel() // block))
    pad = blocks * block - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.reshape(blocks, block).abs().amax(dim=1).float()


def tensorwise_scale(amax: torch.Tensor, fmt: FP8Format | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) as float32 0-d tensors from the per-tensor maximum."""
    fmt = FP8Format.parse(fmt)
    amax = amax.float()
    # a tensor divisor: CUDA torch turns `tensor / python_float` into a multiply by the
    # reciprocal, which rounds differently from the kernels' (and the CPU's) true division
    scale = (amax / torch.full_like(amax, fmt.max)).clamp(min=MIN_SCALE)
    scale = torch.where(amax > 0, scale, 0.0)
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)
    return scale, inv


def quantize_tensorwise(
    x: torch.Tensor, fmt: FP8Format | str = "e4m3", *, block: int = AMAX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, float32 0-d scale): x ~= codes.float() * scale."""
    fmt = FP8Format.parse(fmt)
    if not x.is_floating_point():
        raise TypeError(f"quantize_tensorwise takes a floating-point tensor; got {x.dtype}")
    amax = partial_amax(x, block).amax()  # second stage
    scale, inv = tensorwise_scale(amax, fmt)
    codes = round_to_fp8_grid(x.float() * inv, fmt).to(fmt.dtype)
    return codes, scale


def dequantize_tensorwise(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes.float() * scale, cast to `dtype`."""
    return (codes.float() * scale).to(dtype)


def row_view(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, row_length) with rows over the LAST dim (a 0-d or 1-d tensor is one row).

    Activations are grouped along their last (feature) dim, as COAT does: a group of 16 never
    mixes two tokens. (The optimizer's layout in formats.group uses rows = dim 0 instead.)
    """
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def quantize_lastdim_groups(
    x: torch.Tensor, group_size: int = 16, fmt: FP8Format | str = "e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, float32 scales (rows, groups_per_row)), grouped along the last dim."""
    fmt = FP8Format.parse(fmt)
    if not x.is_floating_point():
        raise TypeError(f"quantize_lastdim_groups takes a floating-point tensor; got {x.dtype}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int; got {group_size!r}")
    codes, scales, _ = quantize_groups(row_view(x).float(), group_size, fmt, expand=False)
    return codes.reshape(x.shape), scales


def dequantize_lastdim_groups(
    codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of quantize_lastdim_groups, cast to `dtype`."""
    out = dequantize_groups(row_view(codes), scales, None, group_size)
    return out.reshape(codes.shape).to(dtype)
