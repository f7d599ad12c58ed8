"""The optimizer-state layout: AdamW's moment names, how a compressed moment is keyed, its format.

The one owner of these names: the optimizer, the fused step's launcher, checkpoints and the CLI
all build and read state-dict keys through this module. A moment is either one float32 tensor
under its torch name, or its group form under the name plus a suffix: FP8 (formats.group; codes
in the parameter's shape) or 4-bit (formats.fp4_moment; packed codes (rows, ceil(cols / 2))).
"""

from __future__ import annotations

import dataclasses

import torch

from .defaults import EXPAND, FORMAT, GROUP_SIZE
from .fp4_moment import FP4Format, decode_moment, encode_moment, rounding_bits
from .fp8 import FP8Format
from .group import dequantize_groups, group_layout, quantize_groups

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""AdamW's moments in torch's state-dict names; the third exists with amsgrad only."""
MOMENTUM = "momentum_buffer"
"""The momentum of SGD and Muon, in torch's state-dict name (Lion's is "exp_avg", as lion-pytorch's)."""
ALL_MOMENTS = (*MOMENTS, MOMENTUM)
"""Every moment name any coatstate optimizer stores (checkpoints and tools read state by these)."""
FIRST_MOMENTS = ("exp_avg", MOMENTUM)
"""Signed moments: they take the first-moment formats (FP8 or "e2m1"), never "ue3m1_sqrt"."""
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


FIRST_MOMENT_ONLY = (FP4Format.E2M1,)
SECOND_MOMENT_ONLY = (FP4Format.UE3M1_SQRT,)


def parse_format(value: FP8Format | FP4Format | str | torch.dtype) -> FP8Format | FP4Format:
    """A moment's storage format: FP8 ("e4m3", "e5m2" or their dtypes) or 4-bit ("e2m1",
    "ue3m1_sqrt")."""
    if isinstance(value, (FP8Format, FP4Format)):
        return value
    if isinstance(value, str) and value.lower() in _FP4_NAMES:
        return _FP4_NAMES[value.lower()]
    try:
        return FP8Format.parse(value)
    except ValueError:
        raise ValueError(
            f"unknown moment format {value!r}: use 'e4m3' or 'e5m2' (FP8), 'e2m1' (4-bit, "
            "exp_avg) or 'ue3m1_sqrt' (4-bit, exp_avg_sq)"
        ) from None


_FP4_NAMES = {f.value: f for f in FP4Format}
FP4_NAMES = frozenset(_FP4_NAMES)
"""the 4-bit moment formats' names, as param groups and checkpoint headers spell them"""


def _option_stem(moment: str) -> str:
    # max_exp_avg_sq shares exp_avg_sq's options; momentum_buffer's are "momentum_*"
    return {"exp_avg": "exp_avg", MOMENTUM: "momentum"}.get(moment, "exp_avg_sq")


def format_option(moment: str) -> str:
    """The param-group option naming `moment`'s format (max_exp_avg_sq shares exp_avg_sq's)."""
    return _option_stem(moment) + "_format"


def expand_option(moment: str) -> str:
    """The param-group option switching `moment`'s range expansion (shared as format_option)."""
    return _option_stem(moment) + "_expand"


def check_moment_format(name: str, fmt: FP8Format | FP4Format, expand: bool) -> None:
    """ValueError naming the fix for a format that does not fit moment `name` ("exp_avg",
    "momentum_buffer" or "exp_avg_sq"), or a 4-bit format with range expansion."""
    if name in FIRST_MOMENTS and fmt in SECOND_MOMENT_ONLY:
        option = format_option(name)
        raise ValueError(
            f"{option}={fmt.value!r} is for the second moment (it is unsigned); use "
            f"{option}='e2m1' for a 4-bit first moment"
        )
    if name not in FIRST_MOMENTS and fmt in FIRST_MOMENT_ONLY:
        raise ValueError(
            f"exp_avg_sq_format={fmt.value!r} is for the first moment (it decodes small values to 0, "
            "and m / sqrt(v) would divide by it); use exp_avg_sq_format='ue3m1_sqrt' for a 4-bit "
            "second moment"
        )
    if isinstance(fmt, FP4Format) and expand:
        raise ValueError(f"4-bit formats take no range expansion; pass {expand_option(name)}=False")


def resolve_expand(fmt: FP8Format | FP4Format, expand: bool | str) -> bool:
    """An expand option as stored: "auto" follows the format (EXPAND for FP8, off for 4-bit)."""
    if expand == "auto":
        return EXPAND if isinstance(fmt, FP8Format) else False
    return expand


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How one optimizer moment is stored."""

    fmt: FP8Format | FP4Format = FP8Format(FORMAT)
    """Format of the codes: FP8 or 4-bit (packed two codes a byte)."""
    expand: bool = EXPAND
    """Dynamic range expansion (COAT sec. 4) on or off (always off for 4-bit)."""
    group_size: int = DEFAULT_GROUP_SIZE
    """Elements per group along a row (even for 4-bit formats)."""

    def __post_init__(self) -> None:
        if self.bits == 4:
            if self.expand:
                raise ValueError(f"4-bit formats take no range expansion; got {self.fmt.value}, expand=True")
            if self.group_size % 2:
                raise ValueError(
                    f"4-bit formats pack two codes a byte within a group: group_size must be even; "
                    f"got {self.group_size}"
                )

    @property
    def bits(self) -> int:
        """Bits per code: 8 (FP8) or 4."""
        return 4 if isinstance(self.fmt, FP4Format) else 8

    def codes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the stored codes for a moment of `shape`: the same for FP8, (rows, ceil(cols
        / 2)) for 4-bit."""
        if self.bits == 8:
            return tuple(shape)
        rows, cols, _ = group_layout(tuple(shape), self.group_size)
        return (rows, (cols + 1) // 2)


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
    codes_shape = moment_format.codes_shape(like.shape)
    state[name + CODES] = torch.zeros(codes_shape, dtype=moment_format.fmt.dtype, device=like.device)
    state[name + SCALES] = torch.zeros((rows, groups), dtype=torch.float32, device=like.device)
    if moment_format.expand:
        # what quantize() gives for an all-zero group: k = 1
        state[name + EXPONENTS] = torch.full((rows, groups), 16, dtype=torch.uint8, device=like.device)


def read_moment(
    state: dict, name: str, group_size: int, moment_format: MomentFormat | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Moment `name` as float32 in the parameter's shape (a view for an uncompressed moment).
    A 4-bit moment's codes do not say their format or the parameter's shape: pass both."""
    if not is_compressed(state, name):
        return state[name]
    codes = state[name + CODES]
    if codes.dtype == torch.uint8:
        if moment_format is None or moment_format.bits != 4 or shape is None:
            raise ValueError(f"{name} is in a 4-bit format: read_moment needs its MomentFormat and shape")
        rows, cols, _ = group_layout(tuple(shape), moment_format.group_size)
        x = decode_moment(codes, state[name + SCALES], cols, moment_format.group_size, moment_format.fmt)
    else:
        shape = codes.shape
        rows, cols, _ = group_layout(codes.shape, group_size)
        x = dequantize_groups(
            codes.reshape(rows, cols), state[name + SCALES], state.get(name + EXPONENTS), group_size
        )
    if name in SECOND_MOMENTS:
        x = torch.where(torch.isnan(x), torch.inf, x)
    return x.reshape(shape)


def write_moment(
    state: dict,
    name: str,
    value: torch.Tensor,
    moment_format: MomentFormat | None,
    rounding: tuple[int, int, int] | None = None,
) -> None:
    """Store float32 `value` into moment `name`, in place (requantized when compressed).
    `rounding` = (seed, step, first element): a ue3m1_sqrt moment rounds stochastically, keyed
    by them (fp4_moment.rounding_bits); other formats ignore it."""
    if moment_format is None:
        if state[name] is not value:
            state[name].copy_(value)
        return
    codes = state[name + CODES]
    rows, cols, _ = group_layout(value.shape, moment_format.group_size)
    if moment_format.bits == 4:
        fmt, group_size = moment_format.fmt, moment_format.group_size
        bits = None
        if rounding is not None and fmt.sqrt:
            bits = rounding_bits(*rounding, rows, cols, device=value.device)
        new_codes, scales = encode_moment(value.reshape(rows, cols), group_size, fmt, bits)
        codes.copy_(new_codes)
        state[name + SCALES].copy_(scales)
        return
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
