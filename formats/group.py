"""The FP8 group format: a tensor as rows of groups, each group with its own scale.

This module is the pure-torch codec. It runs on any device, it is the CPU path, and it is the
oracle the Triton kernels are tested against. The arithmetic is spelled out step by step in
float32 so that a kernel can do the same operations in the same order (docs/FORMAT.md).

Dynamic range expansion folds COAT's centre c into the scale: with y = (|x|/c)**k and
s = max|y| / FP8_MAX, the code is q = y / s = (|x|/a)**k with a = c * s**(1/k) = mx / FP8_MAX**(1/k).
So every group stores one float32 scale `a` (the plain scale when k = 1) and, with expansion,
its exponent as uint8 `16 * k`. That is 5 bytes per 128 elements instead of 12.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from . import portable_math
from .defaults import EXPAND, FORMAT, GROUP_SIZE
from .fp8 import FLOAT_DTYPES, FP8Format, round_to_fp8_grid

EXPONENT_DENOMINATOR = 16
"""k is stored as the integer 16 * k."""
MIN_EXPONENT_CODE = 1
"""Smallest stored 16 * k (k = 1/16): compresses any float32 range into an FP8 one."""
MAX_EXPONENT_CODE = 255
"""Largest stored 16 * k (k = 15.9375): the cap for groups of (almost) equal magnitudes."""
MIN_SCALE = 2.0**-126
"""Scales are kept normal float32 numbers: a group whose max is below FP8_MAX * 2**-126 loses
relative precision (its absolute error stays below 2**-130), never produces Inf or NaN."""

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""Dequantized magnitudes are clamped here: scale * FP8_MAX may round past float32's range."""


def group_layout(shape: torch.Size | tuple[int, ...], group_size: int) -> tuple[int, int, int]:
    """(rows, columns, groups per row) of a tensor of `shape` viewed as rows of groups."""
    if len(shape) >= 2:
        rows = shape[0]
        cols = math.prod(shape[1:])
    else:
        rows, cols = 1, math.prod(shape)
    return rows, cols, max(1, -(-cols // group_size))


@dataclasses.dataclass(frozen=True)
class GroupQuantized:
    """A tensor held as FP8 codes with one float32 scale (and optionally one exponent) per group."""

    codes: torch.Tensor
    """FP8 codes (float8_e4m3fn or float8_e5m2), in the shape of the original tensor."""
    scales: torch.Tensor
    """float32, (rows, groups_per_row): the per-group scale `a`."""
    exponents: torch.Tensor | None
    """uint8, (rows, groups_per_row): 16 * k for dynamic range expansion; None without it."""
    group_size: int
    """Elements per group along a row (the last group of a row may be shorter)."""

    def __post_init__(self) -> None:
        fmt = FP8Format.parse(self.codes.dtype)  # raises for a non-FP8 dtype
        rows, _, groups = group_layout(self.codes.shape, self.group_size)
        if tuple(self.scales.shape) != (rows, groups) or self.scales.dtype != torch.float32:
            raise ValueError(
                f"scales must be float32 of shape {(rows, groups)} for {fmt.value} codes of shape "
                f"{tuple(self.codes.shape)} and group_size {self.group_size}; got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.exponents is not None and (
            self.exponents.shape != self.scales.shape or self.exponents.dtype != torch.uint8
        ):
            raise ValueError(
                f"exponents must be uint8 of shape {(rows, groups)}; got "
                f"{self.exponents.dtype} {tuple(self.exponents.shape)}"
            )

    @property
    def fmt(self) -> FP8Format:
        return FP8Format.parse(self.codes.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def expanded(self) -> bool:
        return self.exponents is not None

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales (+ exponents)."""
        extra = 0 if self.exponents is None else self.exponents.numel()
        return self.codes.numel() + 4 * self.scales.numel() + extra

    def __getitem__(self, index: slice) -> GroupQuantized:
        """A slice along dim 0 is itself a valid compressed tensor (groups never cross a row)."""
        if self.codes.dim() < 2 or not isinstance(index, slice):
            raise TypeError(
                "only a slice along dim 0 of a tensor of rank >= 2 is a compressed tensor; "
                f"got index {index!r} for shape {tuple(self.codes.shape)}"
            )
        return GroupQuantized(
            self.codes[index],
            self.scales[index],
            None if self.exponents is None else self.exponents[index],
            self.group_size,
        )

    def to(self, device: torch.device | str) -> GroupQuantized:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GroupQuantized(move(self.codes), move(self.scales), move(self.exponents), self.group_size)

    def to_flat(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Plain tensors plus a JSON-able header; `from_flat` inverts it exactly."""
        tensors = {"codes": self.codes, "scales": self.scales}
        if self.exponents is not None:
            tensors["exponents"] = self.exponents
        header = {
            "shape": list(self.codes.shape),
            "group_size": self.group_size,
            "format": self.fmt.value,
            "expand": self.expanded,
        }
        return tensors, header

    @classmethod
    def from_flat(cls, tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> GroupQuantized:
        missing = {"codes", "scales"} - tensors.keys()
        if header.get("expand"):
            missing |= {"exponents"} - tensors.keys()
        if missing:
            raise ValueError(f"compressed tensor is missing {sorted(missing)}; header {dict(header)}")
        codes = tensors["codes"]
        if (
            list(codes.shape) != list(header["shape"])
            or FP8Format.parse(codes.dtype).value != header["format"]
        ):
            raise ValueError(
                f"codes are {codes.dtype} {tuple(codes.shape)} but the header says "
                f"{header['format']} {header['shape']}"
            )
        return cls(
            codes,
            tensors["scales"],
            tensors.get("exponents") if header.get("expand") else None,
            int(header["group_size"]),
        )


def storage_bytes(shape: tuple[int, ...], *, group_size: int = GROUP_SIZE, expand: bool = EXPAND) -> int:
    """Bytes a tensor of `shape` takes in the group format, without building it."""
    rows, cols, groups = group_layout(tuple(shape), group_size)
    per_group = 4 + (1 if expand else 0)
    return rows * cols + rows * groups * per_group


def _as_groups(x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, cols) -> (rows, groups, group_size), zero-padded at the end of each row."""
    rows, cols = x2d.shape
    groups = max(1, -(-cols // group_size))
    pad = groups * group_size - cols
    if pad:
        x2d = torch.nn.functional.pad(x2d, (0, pad))
    return x2d.reshape(rows, groups, group_size)


def quantize_groups(
    x2d: torch.Tensor, group_size: int, fmt: FP8Format, expand: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize float32 rows. Returns (codes (rows, cols) fp8, scales, exponents or None).

    The twin of kernels' group encoder: same float32 operations in the same order.
    """
    rows, cols = x2d.shape
    x = _as_groups(x2d.float(), group_size)
    # a NaN or Inf element is stored as the FP8 NaN code and left out of its group's scale, so
    # the group's finite values keep their precision (docs/FORMAT.md, "Non-finite values")
    finite = torch.isfinite(x)
    mag = torch.where(finite, x.abs(), 0.0)
    mx = mag.amax(dim=-1)
    fp8_max = fmt.max
    if expand:
        mn = torch.where(mag > 0, mag, torch.inf).amin(dim=-1)
        log_mx = portable_math.log2(mx)
        log_range = log_mx - portable_math.log2(mn)  # log2(max/min), never overflows
        k16 = torch.floor(
            torch.tensor(EXPONENT_DENOMINATOR * math.log2(fmt.expansion_range), dtype=torch.float32)
            / log_range
        )
        k16 = torch.where(
            mx > 0, k16.clamp(MIN_EXPONENT_CODE, MAX_EXPONENT_CODE), float(EXPONENT_DENOMINATOR)
        )
        inv_k = EXPONENT_DENOMINATOR / k16
        k = k16 / EXPONENT_DENOMINATOR
        # a = mx / FP8_MAX**(1/k), taken in the log domain
        scales = portable_math.exp2(log_mx - math.log2(fp8_max) * inv_k).clamp(min=MIN_SCALE)
        scales = torch.where(mx > 0, scales, 0.0)
        log_scale = portable_math.log2(scales).unsqueeze(-1)
        y = portable_math.exp2(k.unsqueeze(-1) * (portable_math.log2(mag) - log_scale))
        y = torch.where(mag > 0, y, 0.0).copysign(x)
        exponents = k16.to(torch.uint8)
        y = torch.where(finite, y, torch.nan)
    else:
        # the upper clamp keeps FP8_MAX * scale finite for groups whose max is near float32's max
        # a tensor divisor: CUDA torch turns `tensor / python_float` into a multiply by the
        # reciprocal, which would round differently from the kernels' (and the CPU's) true division
        scales = (mx / torch.full_like(mx, fp8_max)).clamp(
            min=MIN_SCALE, max=FLOAT32_MAX / fp8_max * (1 - 2.0**-20)
        )
        scales = torch.where(mx > 0, scales, 0.0)
        inv = torch.where(scales > 0, 1.0 / scales, 0.0)
        y = torch.where(finite, x * inv.unsqueeze(-1), torch.nan)
        exponents = None
    codes = round_to_fp8_grid(y, fmt).to(fmt.dtype)
    codes = codes.reshape(rows, x.shape[1] * group_size)[:, :cols]
    return codes, scales, exponents


def dequantize_groups(
    codes2d: torch.Tensor, scales: torch.Tensor, exponents: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """Float32 (rows, cols) from codes (rows, cols) and per-group scales (and exponents)."""
    rows, cols = codes2d.shape
    q = _as_groups(codes2d.float(), group_size)
    if exponents is None:
        x = q * scales.unsqueeze(-1)
    else:
        inv_k = (EXPONENT_DENOMINATOR / exponents.float()).unsqueeze(-1)
        log_scale = portable_math.log2(scales).unsqueeze(-1)
        log_q = _as_groups(portable_math.log2_of_fp8(codes2d), group_size)
        x = portable_math.exp2(log_q * inv_k + log_scale).clamp(max=FLOAT32_MAX)
        x = torch.where(q != 0, x, 0.0).copysign(q)
    return x.reshape(rows, q.shape[1] * group_size)[:, :cols]


def _check_finite(x: torch.Tensor) -> None:
    bad = x.numel() - int(torch.isfinite(x).sum())
    if bad:
        raise ValueError(
            f"cannot quantize a tensor of shape {tuple(x.shape)} with {bad} non-finite value(s) "
            "(NaN or Inf): find where they come from (a diverging loss, an unscaled fp16 gradient) "
            "and fix or skip that step"
        )


def quantize(
    x: torch.Tensor, *, group_size: int = GROUP_SIZE, fmt: FP8Format | str = FORMAT, expand: bool = EXPAND
) -> GroupQuantized:
    """Compress a float32/bfloat16/float16 tensor into the FP8 group format (pure torch)."""
    fmt = FP8Format.parse(fmt)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 tensors; got {x.dtype}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int; got {group_size!r}")
    _check_finite(x)
    rows, cols, _ = group_layout(x.shape, group_size)
    codes, scales, exponents = quantize_groups(x.reshape(rows, cols), group_size, fmt, expand)
    return GroupQuantized(codes.reshape(x.shape), scales, exponents, group_size)


def dequantize(q: GroupQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float tensor a GroupQuantized stands for, in `dtype` (pure torch)."""
    rows, cols, _ = group_layout(q.shape, q.group_size)
    x = dequantize_groups(q.codes.reshape(rows, cols), q.scales, q.exponents, q.group_size)
    return x.reshape(q.shape).to(dtype)


def error_bound(q: GroupQuantized, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantize(q) - x| that docs/FORMAT.md derives.

    Plain:    max(u * |x|, a * 2**(e_min - m - 1))                 u = 2**-(m+1)
    Expanded: max(((1+u)**(1/k) - 1) * |x|, a * (2**e_min * (1+u))**(1/k)) * (1 + 2**-10)
    (m mantissa bits, e_min the smallest normal exponent; the expanded bound's last factor covers
    float32 log2/exp2 rounding.)
    """
    fmt = q.fmt
    rows, cols, _ = group_layout(q.shape, q.group_size)
    u = 2.0 ** -(fmt.mantissa_bits + 1)
    mag = _as_groups(x.reshape(rows, cols).float().abs(), q.group_size)
    a = q.scales.unsqueeze(-1)
    if q.exponents is None:
        bound = torch.maximum(u * mag, a * 2.0 ** (fmt.min_normal_exponent - fmt.mantissa_bits - 1))
        bound = bound * (1 + 2.0**-16)  # float32 rounding of 1/a and of the products
    else:
        inv_k = (EXPONENT_DENOMINATOR / q.exponents.float()).unsqueeze(-1)
        rel = torch.pow(1 + u, inv_k) - 1
        floor = a * torch.pow(2.0**fmt.min_normal_exponent * (1 + u), inv_k)
        bound = torch.maximum(rel * mag, floor) * (1 + 2.0**-10)
    return bound.reshape(rows, mag.shape[1] * q.group_size)[:, :cols].reshape(q.shape)
