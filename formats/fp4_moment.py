"""The 4-bit optimizer-moment formats: names, and the twin codec the fused step matches bit for bit.

Two formats (issue #33), each a codebook of formats/fp4.py applied per group of G elements along
a row (G even), one float32 scale per group:

  e2m1        the first moment: signed E2M1 codes, scale = the group's max |m|.
  ue3m1_sqrt  the second moments: u = sqrt(v) in the unsigned zero-free ue3m1 codebook,
              scale = the group's max u; v = (level * scale / 192)**2. Zero-free: in a nonzero
              group even v = 0 decodes to the smallest level, so m / sqrt(v) never divides by a
              decoded zero; an all-zero group has scale 0 and decodes to exact zeros.

A nonzero group's scale is at least MIN_SCALE (2**-120) so that top / scale stays finite. The
spec, with the non-finite rule's cost: docs/FORMAT.md, "4-bit optimizer moments".

Codes: uint8 of shape (rows, ceil(cols / 2)), element 2j of a row in the low nibble of byte j,
2j+1 in the high one (an odd row's last high nibble is 0). No range expansion, no exponents.
Non-finite input: a group holding a NaN or Inf stores a NaN scale (its codes are taken from the
finite values), so the whole group decodes to NaN; a second moment reads NaN as +Inf
(formats.optimizer_state.SECOND_MOMENTS), where torch's update is m / Inf = 0.
"""

from __future__ import annotations

import enum

import torch

from .fp4 import CODEBOOKS, decode_levels, encode_groups, pack, unpack
from .rounding_hash import hash32


class FP4Format(str, enum.Enum):
    """4-bit storage format of an optimizer moment: "e2m1" (exp_avg) or "ue3m1_sqrt" (exp_avg_sq)."""

    E2M1 = "e2m1"
    UE3M1_SQRT = "ue3m1_sqrt"

    @property
    def codebook(self) -> str:
        return "e2m1" if self is FP4Format.E2M1 else "ue3m1"

    @property
    def sqrt(self) -> bool:
        """Codes stand for sqrt of the value (the second moment's square root)."""
        return self is FP4Format.UE3M1_SQRT

    @property
    def signed(self) -> bool:
        return CODEBOOKS[self.codebook][1]

    @property
    def top(self) -> float:
        """The codebook's largest level: it stands for the group's scale."""
        return CODEBOOKS[self.codebook][0][-1]

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the stored (packed) codes."""
        return torch.uint8


MIN_SCALE = 2.0**-120
"""A nonzero group's scale is at least this, so top / scale stays finite (a group below it loses
relative precision; its values are below 2**-120 anyway)."""


def _groups(x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = x2d.shape
    groups = max(1, -(-cols // group_size))
    return torch.nn.functional.pad(x2d, (0, groups * group_size - cols)).view(rows, groups, group_size)


ROUNDING_STREAM = 0x2545F491
"""rounding_hash.hash32's stream of the second moment's stochastic rounding (master rounding
uses stream 0 of the same seed and step)."""


def rounding_bits(
    seed: int, step: int, first_element: int, rows: int, cols: int, device=None
) -> torch.Tensor:
    """A random offset below 2**22 (int64, (rows, cols)) per element for the optimizer step's
    stochastic rounding of a ue3m1_sqrt moment (added to y's pattern below its code's bit 22),
    the rows being elements first_element, first_element + 1, ... of their (global) tensor.
    One hash32(seed, step, offset // 2) serves two neighbours: the
    even offset takes its low 16 bits, the odd one its high 16 (the fused step hashes once per
    pair, which halves the hashing). The 16 bits r give the rounding offset 64 r + 32: the
    midpoint of each of the 2**16 bins, so the probability of rounding up is off by less than
    2**-17 either way, no bias on average (the offset is hashed mod 2**32, as hash32 does)."""
    offsets = torch.arange(first_element, first_element + rows * cols, device=device).reshape(rows, cols)
    offsets = offsets & 0xFFFFFFFF
    pair = hash32(seed, step, offsets >> 1, ROUNDING_STREAM)
    return (((pair >> ((offsets & 1) * 16)) & 0xFFFF) << 6) | 32


def encode_moment(
    x2d: torch.Tensor, group_size: int, fmt: FP4Format, rounding: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes (rows, ceil(cols / 2)) uint8, scales (rows, groups) float32) of float32 rows.
    `rounding` (ue3m1_sqrt only: rounding_bits, shaped like x2d) rounds sqrt(v) stochastically
    (formats.fp4.encode_groups), unbiased; without it, to the nearest level."""
    rows, cols = x2d.shape
    x = _groups(x2d.float(), group_size)
    if rounding is not None:
        if not fmt.sqrt:
            raise ValueError(f"stochastic rounding is defined for ue3m1_sqrt only; got {fmt.value!r}")
        rounding = _groups(rounding, group_size)
    # correctly rounded on every device, as the kernel's sqrt_rn: torch's CPU float32 sqrt is
    # not always (1 ulp off, seen on torch 2.13); a float64 sqrt rounded once more is exact
    u = x.double().sqrt().float() if fmt.sqrt else x
    finite = torch.isfinite(u)
    u = torch.where(finite, u, 0.0)
    mx = u.abs().amax(dim=-1)
    scales = torch.where(mx > 0, mx.clamp(min=MIN_SCALE), 0.0)
    codes = encode_groups(u, scales, fmt.codebook, rounding)
    scales = torch.where(finite.all(dim=-1), scales, torch.nan)
    return pack(codes.view(rows, -1), cols), scales


def decode_moment(
    packed: torch.Tensor, scales: torch.Tensor, cols: int, group_size: int, fmt: FP4Format
) -> torch.Tensor:
    """float32 (rows, cols) that (packed, scales) stand for."""
    rows = packed.shape[0]
    values = _groups(decode_levels(unpack(packed, cols), fmt.codebook), group_size)
    step = scales / torch.full_like(scales, fmt.top)  # one true division a group, as the kernel
    u = values * step.unsqueeze(-1)
    x = u * u if fmt.sqrt else u
    return x.reshape(rows, -1)[:, :cols]
