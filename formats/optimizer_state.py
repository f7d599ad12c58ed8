"""The optimizer-state layout: AdamW's moment names, how a compressed moment is keyed, its format.

The one owner of these names: the optimizer, the fused step's launcher, checkpoints and the CLI
all build and read state-dict keys through this module. A moment is either one float32 tensor
under its torch name, or its FP8 group form (formats.group) under the name plus a suffix.
"""

from __future__ import annotations

import dataclasses

import torch

from .defaults import EXPAND, FORMAT, GROUP_SIZE
from .fp8 import FP8Format
from .group import dequantize_groups, group_layout, quantize_groups

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""AdamW's moments in torch's state-dict names; the third exists with amsgrad only."""
CODES, SCALES, EXPONENTS = "_codes", "_scales", "_exponents"
"""A compressed moment N is stored as N_codes, N_scales and (expanded only) N_exponents."""
COMPRESSED_SUFFIXES = (CODES, SCALES, EXPONENTS)
MASTER_CORRECTION = "master_correction"
"""State key of a 16-bit parameter's master-weight correction (formats.master_weights)."""
DEFAULT_GROUP_SIZE = GROUP_SIZE
"""Elements per group of an optimizer moment along a row (formats.defaults)."""
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
"""Moments that read a stored NaN code back as +Inf. The codec stores NaN and Inf alike as the
FP8 NaN code (e4m3 has no Inf). A second moment is a sum of squares: it is NaN only where a NaN
gradient already made exp_avg NaN, and +Inf where g*g overflowed, where torch's update is
m / Inf = 0. Reading +Inf keeps that parameter finite and unchanged, as torch does; where
exp_avg is NaN the parameter goes NaN either way, as in torch."""


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How one optimizer moment is stored."""

    fmt: FP8Format = FP8Format(FORMAT)
    """FP8 format of the codes."""
    expand: bool = EXPAND
    """Dynamic range expansion (COAT sec. 4) on or off."""
    group_size: int = DEFAULT_GROUP_SIZE
    """Elements per group along a row."""


def state_keys(name: str, moment_format: MomentFormat | None) -> tuple[str, ...]:
    """The state-dict keys that hold moment `name` in `moment_format` (None: one fp32 tensor)."""
    if moment_format is None:
        return (name,)
    keys = (name + CODES, name + SCALES)
    return keys + ((name + EXPONENTS,) if moment_format.expand else ())


def is_compressed(state: dict, name: str) -> bool:
    return name + CODES in state


def init_moment(state: dict, name: str, like: torch.Tensor, moment_format: MomentFormat | None) -> None:
    """Zero moment `name` for a parameter shaped like `like` (its local shard for a DTensor)."""
    if moment_format is None:
        state[name] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        return
    rows, _, groups = group_layout(like.shape, moment_format.group_size)
    state[name + CODES] = torch.zeros(like.shape, dtype=moment_format.fmt.dtype, device=like.device)
    state[name + SCALES] = torch.zeros((rows, groups), dtype=torch.float32, device=like.device)
    if moment_format.expand:
        # what quantize() gives for an all-zero group: k = 1
        state[name + EXPONENTS] = torch.full((rows, groups), 16, dtype=torch.uint8, device=like.device)


def read_moment(state: dict, name: str, group_size: int) -> torch.Tensor:
    """Moment `name` as float32 in the parameter's shape (a view for an uncompressed moment)."""
    if not is_compressed(state, name):
        return state[name]
    codes = state[name + CODES]
    rows, cols, _ = group_layout(codes.shape, group_size)
    x = dequantize_groups(
        codes.reshape(rows, cols), state[name + SCALES], state.get(name + EXPONENTS), group_size
    )
    if name in SECOND_MOMENTS:
        x = torch.where(torch.isnan(x), torch.inf, x)
    return x.reshape(codes.shape)


def write_moment(state: dict, name: str, value: torch.Tensor, moment_format: MomentFormat | None) -> None:
    """Store float32 `value` into moment `name`, in place (requantized when compressed)."""
    if moment_format is None:
        if state[name] is not value:
            state[name].copy_(value)
        return
    codes = state[name + CODES]
    rows, cols, _ = group_layout(codes.shape, moment_format.group_size)
    new_codes, scales, exponents = quantize_groups(
        value.reshape(rows, cols), moment_format.group_size, moment_format.fmt, moment_format.expand
    )
    codes.copy_(new_codes.reshape(codes.shape))
    state[name + SCALES].copy_(scales)
    if exponents is not None:
        state[name + EXPONENTS].copy_(exponents)


def moment_of(state_name: str) -> tuple[str, str] | None:
    """('exp_avg', '_codes') for 'exp_avg_codes'; None for a tensor that is not a compressed part."""
    for suffix in COMPRESSED_SUFFIXES:
        if state_name.endswith(suffix) and len(state_name) > len(suffix):
            return state_name[: -len(suffix)], suffix
    return None
