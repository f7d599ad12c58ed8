"""Optimizer state dicts in and out: a saved state in this optimizer's format, and the
conversions between torch.optim.AdamW's state dicts and CompressedAdamW's."""

from __future__ import annotations

import logging
from typing import Any

import torch
from coatstate.formats.optimizer_state import (
    CODES,
    DEFAULT_GROUP_SIZE,
    EXPONENTS,
    MASTER_CORRECTION,
    MOMENTS,
    SCALES,
    init_moment,
    is_compressed,
    read_moment,
    write_moment,
)

from coatstate.distributed import check_compressible, is_dtensor, local_chunk, local_tensor, wrap_state
from coatstate.formats.master_weights import CORRECTION_DTYPES
from coatstate.optim.moments import FORMAT_DEFAULTS, global_shape, master_mode, moment_formats

logger = logging.getLogger("coatstate")


def convert_param_state(saved: dict, p: torch.Tensor, group: dict) -> dict:
    """One parameter's saved state, in this group's format for `p`, on p's device."""
    local = local_tensor(p)
    formats = moment_formats(group, global_shape(p))
    saved_group_size = group.get("group_size", DEFAULT_GROUP_SIZE)
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "step":
            step = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            on_device = local.is_cuda and group.get("fused") is not False
            out["step"] = (
                step.detach().to(dtype=torch.float32, device=local.device if on_device else "cpu").clone()
            )
    for name in MOMENTS:
        if name not in saved and name + CODES not in saved:
            continue
        src = {
            k: (_local_part(v, p).to(local.device) if isinstance(v, torch.Tensor) else v)
            for k, v in saved.items()
        }
        if not is_compressed(src, name) and tuple(src[name].shape) != tuple(local.shape):
            raise ValueError(
                f"state {name!r} has shape {tuple(src[name].shape)} but its parameter has shape "
                f"{tuple(local.shape)}"
            )
        if is_compressed(src, name) and tuple(src[name + CODES].shape) != tuple(local.shape):
            raise ValueError(
                f"state {name}_codes has shape {tuple(src[name + CODES].shape)} but its parameter has "
                f"shape {tuple(local.shape)}"
            )
        value = read_moment(src, name, saved_group_size).float()
        init_moment(out, name, local, formats[name])
        if formats[name] is None:
            out[name].copy_(value)
        else:
            same = (
                is_compressed(src, name)
                and src[name + CODES].dtype == formats[name].fmt.dtype
                and (name + EXPONENTS in src) == formats[name].expand
                and src[name + SCALES].shape == out[name + SCALES].shape
            )
            if same:  # already in this format: copy the bits, never requantize (bit-exact resume)
                for k in (name + CODES, name + SCALES, name + EXPONENTS):
                    if k in src:
                        out[k].copy_(src[k])
            else:
                write_moment(out, name, value, formats[name])
    _convert_master_correction(saved, out, p, group, local)
    if "step" not in out:
        raise ValueError("parameter state has no 'step'")
    if is_dtensor(p):
        if any(is_compressed(out, name) for name in MOMENTS):
            check_compressible(p, f"of global shape {tuple(p.shape)}")
        wrap_state(out, p)
    return out


def _local_part(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of a saved state tensor that belongs to this rank's shard of `p`: a DTensor's
    local shard, or for a DTensor `p` and a full (gathered) tensor, its rows of it."""
    if is_dtensor(value):
        return local_tensor(value)
    if is_dtensor(p) and value.ndim > 0:
        return local_chunk(value, p)
    return value


def _format_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = set(kwargs) - set(FORMAT_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown format option(s) {sorted(unknown)}; allowed: {sorted(FORMAT_DEFAULTS)}")
    return {**FORMAT_DEFAULTS, **kwargs}


def compress_adamw_state_dict(state_dict: dict[str, Any], **format_options: Any) -> dict[str, Any]:
    """A torch.optim.AdamW state dict -> a CompressedAdamW one (format options as its constructor's)."""
    options = _format_kwargs(format_options)
    groups, state = [], {}
    for saved in state_dict["param_groups"]:
        group = {**saved, **options}
        groups.append(group)
        for pid in saved["params"]:
            if pid not in state_dict["state"]:
                continue
            s = state_dict["state"][pid]
            formats = moment_formats(group, s["exp_avg"].shape)
            out = {
                "step": s["step"].clone()
                if isinstance(s["step"], torch.Tensor)
                else torch.tensor(float(s["step"]))
            }
            for name in MOMENTS:
                if name in s:
                    init_moment(out, name, s[name], formats[name])
                    write_moment(out, name, s[name].float(), formats[name])
            state[pid] = out
    return {"state": state, "param_groups": groups}


def to_adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A CompressedAdamW state dict -> one torch.optim.AdamW loads (moments decompressed to fp32)."""
    groups, state = [], {}
    for saved in state_dict["param_groups"]:
        groups.append({k: v for k, v in saved.items() if k not in FORMAT_DEFAULTS})
        g = saved.get("group_size", DEFAULT_GROUP_SIZE)
        for pid in saved["params"]:
            if pid not in state_dict["state"]:
                continue
            s = state_dict["state"][pid]
            out = {"step": s["step"]}
            for name in MOMENTS:
                if name in s or name + CODES in s:
                    out[name] = read_moment(s, name, g).float().clone()
            state[pid] = out
    return {"state": state, "param_groups": groups}


def _convert_master_correction(saved: dict, out: dict, p: torch.Tensor, group: dict, local: torch.Tensor) -> None:
    """The master-weight correction of a bfloat16 parameter in this group's mode: copied when the
    saved one is in it, else zero (the weight alone is then the master: precision below the
    weight's is lost once, and said so)."""
    mode = master_mode(group, p)
    if mode not in CORRECTION_DTYPES:
        return
    want = CORRECTION_DTYPES[mode]
    have = saved.get(MASTER_CORRECTION)
    if isinstance(have, torch.Tensor):
        have = _local_part(have, p)
        if have.dtype == want and tuple(have.shape) == tuple(local.shape):
            out[MASTER_CORRECTION] = have.to(local.device).clone()
            return
    if have is not None:
        logger.warning(
            "coatstate: a saved master correction (%s) does not fit master_bits=%d; starting from the "
            "weight alone",
            getattr(have, "dtype", type(have).__name__),
            mode,
        )
    out[MASTER_CORRECTION] = torch.zeros_like(local, dtype=want)
