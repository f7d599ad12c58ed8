"""Which moments of a parameter are compressed and how (param-group options -> MomentFormat), and
what an optimizer's state costs in bytes."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from coatstate.formats.defaults import MOMENTUM_DEFAULTS, OPTIMIZER_DEFAULTS
from coatstate.formats.optimizer_state import (
    MOMENTS,
    MomentFormat,
    expand_option,
    format_option,
    parse_format,
    resolve_expand,
)

FORMAT_DEFAULTS: dict[str, Any] = dict(OPTIMIZER_DEFAULTS)
"""coatstate's own param-group keys (beside torch.optim.AdamW's) and their defaults, as
formats.defaults holds them (the one table)."""
_ALL_DEFAULTS: dict[str, Any] = {**MOMENTUM_DEFAULTS, **OPTIMIZER_DEFAULTS}
"""every optimizer's own options: the fallback of a group that lacks one"""


def global_shape(p: torch.Tensor) -> torch.Size:
    """The full shape of a parameter: a DTensor's global shape, never its local shard's."""
    return p.shape  # DTensor.shape is the global shape


def _option(group: dict, key: str) -> Any:
    return group.get(key, _ALL_DEFAULTS[key])


def moment_formats(
    group: dict, shape: torch.Size, moments: tuple[str, ...] = MOMENTS
) -> dict[str, MomentFormat | None]:
    """How each of `moments` (AdamW's by default) of a parameter of global `shape` is stored
    (None: float32)."""
    options = tuple((k, group.get(k, _ALL_DEFAULTS[k])) for k in _option_keys(moments))
    try:
        return dict(_moment_formats(tuple(shape), moments, options))
    except TypeError:  # an unhashable option value: parsed (or refused) without the cache
        return dict(_moment_formats.__wrapped__(tuple(shape), moments, options))


@functools.cache
def _option_keys(moments: tuple[str, ...]) -> tuple[str, ...]:
    """The param-group options moment_formats reads for `moments`."""
    per_moment = (k for m in moments for k in (format_option(m), expand_option(m)))
    return ("compress", "min_numel", "compress_1d", "group_size", *per_moment)


# every parameter asks every step: parsing the options each time was most of the step's host time
@functools.lru_cache(maxsize=4096)
def _moment_formats(shape: tuple, moments: tuple[str, ...], options: tuple) -> dict[str, MomentFormat | None]:
    group = dict(options)
    numel = math.prod(shape)
    compress = group["compress"] and numel >= group["min_numel"] and (len(shape) >= 2 or group["compress_1d"])
    if not compress:
        return dict.fromkeys(moments)
    g = group["group_size"]
    out = {}
    for moment in moments:
        fmt = parse_format(group[format_option(moment)])
        out[moment] = MomentFormat(fmt, resolve_expand(fmt, group[expand_option(moment)]), g)
    return out


def master_mode(group: dict, p: torch.Tensor) -> int | None:
    """The master-weight mode a parameter steps with: the group's master_bits for a bfloat16
    parameter, None (the parameter is its own master) for a float32 one."""
    bits = group.get("master_bits")
    return bits if bits is not None and p.dtype == torch.bfloat16 else None


def why_uncompressed(group: dict, shape: torch.Size) -> str:
    if not _option(group, "compress"):
        return "compression is off for its param group"
    if len(shape) < 2 and not _option(group, "compress_1d"):
        return "1-D parameter (norm weight or bias)"
    return f"{math.prod(shape)} elements < min_numel={_option(group, 'min_numel')}"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of any optimizer's state tensors held on this process, step counters left out: a
    DTensor counts its local shard, a tensor subclass (torchao's low-bit states) what it stores."""

    def nbytes(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()  # a DTensor also names its device_mesh here
            inner = (getattr(t, n) for n in names)
            return sum(nbytes(x) for x in inner if isinstance(x, torch.Tensor))
        return t.numel() * t.element_size()

    return sum(
        nbytes(t)
        for state in optimizer.state.values()
        for key, t in state.items()
        if key != "step" and isinstance(t, torch.Tensor)
    )
