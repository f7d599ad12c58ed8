"""Which moments of a parameter are compressed and how (param-group options -> MomentFormat), the
check of those options, and what an optimizer's state costs in bytes."""

from __future__ import annotations

import math
from typing import Any

import torch

from coatstate.formats import FP8Format
from coatstate.formats.defaults import OPTIMIZER_DEFAULTS
from coatstate.formats.master_weights import MASTER_BITS
from coatstate.formats.optimizer_state import MOMENTS, MomentFormat

FORMAT_DEFAULTS: dict[str, Any] = dict(OPTIMIZER_DEFAULTS)
"""coatstate's own param-group keys (beside torch.optim.AdamW's) and their defaults, as
formats.defaults holds them (the one table)."""


def global_shape(p: torch.Tensor) -> torch.Size:
    """The full shape of a parameter: a DTensor's global shape, never its local shard's."""
    return p.shape  # DTensor.shape is the global shape


def _option(group: dict, key: str) -> Any:
    return group.get(key, FORMAT_DEFAULTS[key])


def moment_formats(group: dict, shape: torch.Size) -> dict[str, MomentFormat | None]:
    """How each moment of a parameter of global `shape` is stored (None: float32)."""
    numel = math.prod(shape)
    compress = (
        _option(group, "compress")
        and numel >= _option(group, "min_numel")
        and (len(shape) >= 2 or _option(group, "compress_1d"))
    )
    if not compress:
        return dict.fromkeys(MOMENTS)
    g = _option(group, "group_size")
    first = MomentFormat(
        FP8Format.parse(_option(group, "exp_avg_format")), _option(group, "exp_avg_expand"), g
    )
    second = MomentFormat(
        FP8Format.parse(_option(group, "exp_avg_sq_format")), _option(group, "exp_avg_sq_expand"), g
    )
    return {"exp_avg": first, "exp_avg_sq": second, "max_exp_avg_sq": second}


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


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_group(gi: int, group: dict[str, Any]) -> None:
    """A param group's options, checked when the group is added or loaded (ValueError naming the
    group and the option): torch's hyperparameters as CompressedAdamW's constructor checks them,
    and every coatstate option, so that a bad one fails here rather than at the first step.
    master_bits must be resolved ("auto" is the constructor's and add_param_group's to resolve)."""
    lr, betas = group["lr"], group["betas"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"param group {gi}: tensor lr must have one element; got {tuple(lr.shape)}")
    elif not (_number(lr) and lr >= 0):
        raise ValueError(f"param group {gi}: lr must be a number >= 0; got {lr!r:.40}")
    if not (
        isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)
    ):
        raise ValueError(f"param group {gi}: betas must be two floats in [0, 1); got {betas!r:.60}")
    for key in ("eps", "weight_decay"):
        if not (_number(group[key]) and group[key] >= 0):
            raise ValueError(f"param group {gi}: {key} must be a number >= 0; got {group[key]!r:.40}")
    for key in ("group_size", "min_numel", "master_seed"):
        v, least = group[key], 1 if key == "group_size" else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"param group {gi}: {key} must be an int >= {least}; got {v!r:.40}")
    for key in ("compress", "exp_avg_expand", "exp_avg_sq_expand", "compress_1d"):
        if not isinstance(group[key], bool):
            raise ValueError(f"param group {gi}: {key} must be True or False; got {group[key]!r:.40}")
    if isinstance(group["master_bits"], bool) or group["master_bits"] not in (None, *MASTER_BITS):
        raise ValueError(
            f"param group {gi}: master_bits must be None, 16, 24 or 32; got {group['master_bits']!r:.40}"
        )
    for key in ("exp_avg_format", "exp_avg_sq_format"):
        try:
            FP8Format.parse(group[key])
        except (ValueError, TypeError) as e:
            raise ValueError(f"param group {gi}: {key}: {e}") from None


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
