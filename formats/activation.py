"""The saved-activation format: FP8 codes with power-of-two scales of one byte (E8M0).

Byte b stands for the scale 2**(b-127) (as in the MX formats); 255 marks a tensor or group whose
maximum was NaN or Inf (it unpacks to NaN). One scale per tensor, or one per group of
`group_size` consecutive elements of a row. Scales are chosen so that nothing saturates.
This is the pure-torch codec: the CPU path and the oracle of coatstate.kernels.activation,
which computes the same integer and float32 operations.
"""

from __future__ import annotations

import torch

from .fp8 import FP8Format, round_to_fp8_grid

NAN_SCALE = 255
"""Scale byte of a tensor or group whose max|x| is NaN or Inf: it unpacks to NaN."""
MIN_SCALE_EXPONENT = -126
"""Smallest scale exponent (scales stay normal float32 numbers)."""


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bits of |x| as int32: integer order is |x|'s order, NaN above Inf."""
    return x.float().view(torch.int32) & 0x7FFFFFFF


def _scale_exponent(amax_bits: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, scale byte): the smallest e >= -126 with max|x| <= FP8_MAX * 2**e (nothing saturates)."""
    emax = int(fmt.max).bit_length() - 1  # FP8_MAX = 1.75 * 2**emax for both formats
    mmax = int((fmt.max / 2**emax - 1) * 2**23)
    raw = amax_bits >> 23
    e = (raw - (127 + emax) + ((amax_bits & 0x7FFFFF) > mmax).int()).clamp(min=MIN_SCALE_EXPONENT)
    return e, torch.where(raw == 255, NAN_SCALE, e + 127).to(torch.uint8)


def _encode(x: torch.Tensor, e: torch.Tensor, byte: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    inv = ((127 - e) << 23).view(torch.float32)  # 2**-e exactly
    y = torch.where(byte == NAN_SCALE, 0.0, x.float() * inv)  # the NaN scale byte marks the group
    return round_to_fp8_grid(y, fmt).to(fmt.dtype)


def _decode(codes: torch.Tensor, byte: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = (byte.int() << 23).view(torch.float32)  # 2**(byte - 127) exactly
    scale = torch.where(byte == NAN_SCALE, torch.nan, scale)
    big = torch.finfo(dtype).max
    return (codes.float() * scale).clamp(-big, big).to(dtype)


def pack_tensor(x: torch.Tensor, fmt: FP8Format | str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's shape, scale byte (1,) uint8): x ~= codes * 2**(scale - 127)."""
    fmt = FP8Format.parse(fmt)
    amax = _abs_bits(x).amax().reshape(1) if x.numel() else torch.zeros(1, dtype=torch.int32, device=x.device)
    e, byte = _scale_exponent(amax, fmt)
    return _encode(x, e, byte, fmt), byte


def unpack_tensor(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of pack_tensor, in `dtype`."""
    return _decode(codes, scale, dtype)


def _as_groups(x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, cols) -> (rows, groups, group_size), zero-padded at the end of each row."""
    rows, cols = x2d.shape
    pad = -cols % group_size
    if pad or cols == 0:
        x2d = torch.nn.functional.pad(x2d, (0, pad if cols else group_size))
    return x2d.reshape(rows, max(1, -(-cols // group_size)), group_size)


def pack_groups(x2d: torch.Tensor, group_size: int = 16, fmt: FP8Format | str = "e4m3"):
    """(codes (rows, cols), scale bytes (rows, groups_per_row) uint8) of a 2-D tensor."""
    fmt = FP8Format.parse(fmt)
    rows, cols = x2d.shape
    x = _as_groups(x2d, group_size)
    e, byte = _scale_exponent(_abs_bits(x).amax(dim=-1), fmt)
    codes = _encode(x, e.unsqueeze(-1), byte.unsqueeze(-1), fmt)
    return codes.reshape(rows, x.shape[1] * group_size)[:, :cols], byte


def unpack_groups(codes2d: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype):
    """The inverse of pack_groups, in `dtype`."""
    rows, cols = codes2d.shape
    x = _decode(_as_groups(codes2d.float(), group_size), scales.unsqueeze(-1), dtype)
    return x.reshape(rows, x.shape[1] * group_size)[:, :cols]
