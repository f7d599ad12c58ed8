"""4-bit group formats for optimizer moments: candidates, pure-torch reference codecs (issue #33).

A tensor is viewed as rows and groups of consecutive elements, exactly as the FP8 group format
(formats/group.py): groups never cross a row, so a dim-0 slice of a compressed tensor is again one.
Each group stores one float32 scale, its largest magnitude; each element a 4-bit code, two codes
per byte along the row (element 2j in the low nibble, 2j+1 in the high one; an odd row is padded).
A code indexes a codebook of magnitudes; the largest stands for the scale:

  e2m1       signed E2M1 (OCP FP4): {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign bit
  e2m1_nz    the same without the zero code for nonzero inputs: a nonzero value never decodes
             to 0 (for the second moment, whose zeros make m / sqrt(v) explode: Li et al. 2023)
  linear_nz  unsigned, 16 levels 1..16, no zero code at all (non-negative inputs only:
             the second moment), the linear zero-free mapping of Li et al.
  ue3m1      unsigned, zero-free, 16 levels m * 2**e (e in 0..7, m in {1, 1.5}): 1, 1.5, 2, 3,
             ..., 128, 192; code i is level e = i >> 1, m = 1 + (i & 1) / 2. Used on sqrt(v)
             by the optimizer's "ue3m1_sqrt" second-moment format (formats/fp4_moment.py)

Rounding goes to the nearest codebook value, ties to the even code index (for e2m1 that is
round-to-nearest-even). An all-zero group has scale 0 and decodes to exact zeros. The optimizer
uses e2m1 and ue3m1 through formats/fp4_moment.py; the others exist to be measured
(benchmarks/experiments/fp4_reconstruction.py).
"""

from __future__ import annotations

import torch

from .group import group_layout

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CODEBOOKS: dict[str, tuple[tuple[float, ...], bool]] = {  # name: (magnitudes, signed)
    "e2m1": (_E2M1, True),
    "e2m1_nz": (_E2M1, True),
    "linear_nz": (tuple(float(i + 1) for i in range(16)), False),
    "ue3m1": (tuple(float((1 + (i & 1) / 2) * 2 ** (i >> 1)) for i in range(16)), False),
}
"""Magnitudes in the codebook's own units (exact in float32, so ties are exact); a group's
largest magnitude maps onto the last one."""
ZERO_FREE = {"e2m1_nz", "linear_nz", "ue3m1"}
"""Codebooks under which a nonzero input never decodes to zero."""


def _codebook(name: str) -> tuple[torch.Tensor, bool]:
    if name not in CODEBOOKS:
        raise ValueError(f"unknown 4-bit codebook {name!r}; choose from {', '.join(CODEBOOKS)}")
    mags, signed = CODEBOOKS[name]
    return torch.tensor(mags, dtype=torch.float32), signed


def _nearest(mag: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level to each magnitude (levels ascending), ties to the even index."""
    mids = (levels[1:] + levels[:-1]) / 2
    idx = torch.bucketize(mag, mids)  # mids[i-1] < mag <= mids[i] gives i: a tie lands low
    tie = mag == mids[idx.clamp(max=len(mids) - 1)]
    return torch.where(tie & (idx % 2 == 1), idx + 1, idx)


def encode_groups(
    padded: torch.Tensor, scales: torch.Tensor, codebook: str, rounding: torch.Tensor | None = None
) -> torch.Tensor:
    """4-bit codes (uint8, one per element) of float32 groups (rows, groups, G) with their
    per-group scales: the float32 operations of the fused step's encoder, in its order (one
    division a group, a multiply and the nearest level per element).

    `rounding` (ue3m1 only): a random offset in [0, 2**22) per element (int64, shaped like
    `padded`; fp4_moment.rounding_bits) that rounds stochastically instead: up to the next level
    with probability (y - lower) / (upper - lower), so the decoded value is unbiased. ue3m1's
    levels are the floats with a 1-bit mantissa from 1 up, so within a level's interval y is
    linear in its 22 low mantissa bits: adding the offset and truncating at bit 22 does it in
    integers, exactly for a uniform offset (below level 1: level 1)."""
    levels, signed = _codebook(codebook)
    top = levels[-1].item()
    # one true division a group (a tensor numerator: the kernel's div_rn on every device)
    to_units = torch.where(scales > 0, torch.full_like(scales, top) / scales, 0.0).unsqueeze(-1)
    y = (padded.abs() * to_units).clamp(max=top)
    if rounding is not None:
        if codebook != "ue3m1":
            raise ValueError(f"stochastic rounding is defined for the ue3m1 codebook only; got {codebook!r}")
        bits = y.view(torch.int32).to(torch.int64)
        return (((bits + rounding) >> 22) - 254).clamp(0, 15).to(torch.uint8)
    idx = _nearest(y, levels.to(padded.device))
    if codebook == "e2m1_nz":  # a nonzero value keeps at least the smallest nonzero level
        idx = torch.where((padded != 0) & (idx == 0), 1, idx)
    return idx.to(torch.uint8) | ((padded < 0).to(torch.uint8) << 3 if signed else 0)


def pack(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """(rows, >= cols) 4-bit codes -> (rows, ceil(cols / 2)) bytes, element 2j in the low nibble;
    an odd row's last high nibble is 0."""
    codes = codes[:, :cols]
    if cols % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of `pack`: (rows, cols) uint8 codes."""
    rows = packed.shape[0]
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(rows, 2 * packed.shape[-1])[:, :cols]


def decode_levels(codes: torch.Tensor, codebook: str) -> torch.Tensor:
    """float32 codebook values (signed, in the codebook's units) of uint8 4-bit codes."""
    levels, signed = _codebook(codebook)
    values = levels.to(codes.device)[(codes & 7 if signed else codes).long()]
    return torch.where(codes >= 8, -values, values) if signed else values


def quantize_fp4(
    x: torch.Tensor, *, group_size: int = 128, codebook: str = "e2m1"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes of shape (rows, ceil(cols / 2)), float32 scales (rows, groups)) of x."""
    _, signed = _codebook(codebook)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int; got {group_size!r}")
    if not torch.isfinite(x).all():
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)} holding NaN or Inf to 4 bits")
    if not signed and (x < 0).any():
        raise ValueError(
            f"codebook {codebook!r} is unsigned (second moments); the tensor has negative values"
        )
    rows, cols, groups = group_layout(x.shape, group_size)
    x2d = x.reshape(rows, cols).float()
    padded = torch.nn.functional.pad(x2d, (0, groups * group_size - cols)).view(rows, groups, group_size)
    scales = padded.abs().amax(dim=-1)
    codes = encode_groups(padded, scales, codebook)
    return pack(codes.view(rows, groups * group_size), cols), scales


def dequantize_fp4(
    packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], *, group_size: int = 128,
    codebook: str = "e2m1",
) -> torch.Tensor:  # fmt: skip
    """The float32 tensor of `shape` that (packed, scales) stand for."""
    levels, _ = _codebook(codebook)
    rows, cols, groups = group_layout(tuple(shape), group_size)
    values = decode_levels(unpack(packed, cols), codebook)
    values = torch.nn.functional.pad(values, (0, groups * group_size - cols)).view(rows, groups, group_size)
    out = (values * (scales / levels[-1]).unsqueeze(-1)).view(rows, groups * group_size)[:, :cols]
    return out.reshape(shape)


def storage_bytes_fp4(shape: tuple[int, ...], *, group_size: int = 128) -> int:
    """Bytes of a tensor of `shape` in a 4-bit group format: codes plus one float32 scale a group."""
    rows, cols, groups = group_layout(tuple(shape), group_size)
    return rows * ((cols + 1) // 2) + rows * groups * 4
