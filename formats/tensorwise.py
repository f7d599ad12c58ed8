"""FP8Linear's GEMM operands: FP8 with one float32 scale per tensor (torch._scaled_mm's input).

The pure-torch twin of coatstate.kernels.tensorwise: the CPU path and the oracle.

amax = max|x| taken in two stages, first one
maximum per block of `AMAX_BLOCK` consecutive elements (the flat order), then the maximum of
those. A maximum is exact, so the two-stage order gives the same amax as any other order; it is
spelled out here because the kernel does it that way. Then, in float32:

    s = max(amax / FP8_MAX, MIN_SCALE)   (0 when amax == 0)
    inv = 1 / s                           (0 when s == 0)
    q = fp8(round_to_fp8_grid(x * inv))

Every division is a correctly rounded float32 division and the rounding onto the FP8 grid is
done in float32 before the cast, so the Triton kernels (which use `div_rn` and the same
rounding) agree with these functions bit for bit, also in Triton's interpreter.

Non-finite inputs are not checked (that would cost a device sync per GEMM): a NaN or
Inf gives NaN after the round trip, so it shows up in the gradients instead of being hidden.
"""

from __future__ import annotations

import torch

from .fp8 import FP8Format, round_to_fp8_grid
from .group import MIN_SCALE

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
