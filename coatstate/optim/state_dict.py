"""Optimizer state dicts in and out: a saved state in this optimizer's format, and the
conversions between torch.optim.AdamW's state dicts and CompressedAdamW's."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from coatstate.distributed import check_compressible, is_dtensor, local_chunk, local_tensor, wrap_state
from coatstate.formats.defaults import LION_DEFAULTS, MOMENTUM_DEFAULTS, OPTIMIZER_DEFAULTS
from coatstate.formats.master_weights import CORRECTION_DTYPES
from coatstate.formats.optimizer_schema import kind_of
from coatstate.formats.optimizer_state import (
    ALL_MOMENTS,
    CODES,
    DEFAULT_GROUP_SIZE,
    EXPONENTS,
    MASTER_CORRECTION,
    MOMENTS,
    MOMENTUM,
    SCALES,
    MomentFormat,
    check_moment_format,
    expand_option,
    format_option,
    init_moment,
    is_compressed,
    parse_format,
    read_moment,
    resolve_expand,
    write_moment,
)
from coatstate.optim.moments import FORMAT_DEFAULTS, global_shape, master_mode, moment_formats
from coatstate.optim.options import check_group

logger = logging.getLogger("coatstate")


TORCH_GROUP_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
"""What torch.optim.AdamW.__setstate__ fills into a loaded param group that lacks the key (a
state dict of an older torch)."""


def loaded_state(
    groups: list[dict[str, Any]],
    state_dict: Any,
    convert: Callable[[dict, torch.Tensor, dict], dict],
    torch_defaults: dict[str, Any] = TORCH_GROUP_DEFAULTS,
    check: Callable[[int, dict], None] = check_group,
) -> tuple[list[dict[str, Any]], dict[Any, Any]]:
    """(param groups, state) that a compressed optimizer's load_state_dict installs for
    `state_dict`, given the optimizer's current `groups`; every value checked (`check`, per
    group), ValueError before anything changes. Keys the loaded groups lack get `torch_defaults`
    (the reference's __setstate__ defaults), then the optimizer's own values.

    `convert(saved, p, group)` puts one parameter's saved state into the group's format.
    """
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("not an optimizer state dict: expected keys 'state' and 'param_groups'")
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} param groups, this optimizer has {len(groups)}"
        )
    id_to_param: dict[Any, torch.Tensor] = {}
    new_groups = []
    for gi, (mine, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise ValueError(f"param group {gi} of the loaded state dict has no 'params' list")
        if len(mine["params"]) != len(saved["params"]):
            raise ValueError(
                f"param group {gi}: loaded state has {len(saved['params'])} parameters, this "
                f"optimizer has {len(mine['params'])}"
            )
        id_to_param.update(zip(saved["params"], mine["params"], strict=True))
        merged = copy.deepcopy({k: v for k, v in saved.items() if k != "params"})  # as torch: no aliasing
        for key, default in torch_defaults.items():
            merged.setdefault(key, default)
        for key, value in mine.items():  # hyperparameters, then coatstate's options
            if key not in ("params", "param_names"):
                merged.setdefault(key, value)
        for key in ("capturable", "differentiable"):  # coatstate's optimizers run neither mode
            if key in merged:
                merged[key] = False
        if "param_names" in mine and "param_names" not in merged:
            merged["param_names"] = mine["param_names"]
        merged["params"] = mine["params"]
        check(gi, merged)
        new_groups.append(merged)
    group_of = {id(p): g for g in new_groups for p in g["params"]}
    new_state: dict[Any, Any] = {}
    for pid, saved_state in state_dict["state"].items():
        if pid not in id_to_param:  # as torch: state that belongs to no parameter is kept as it is
            new_state[pid] = saved_state
            continue
        p = id_to_param[pid]
        try:
            new_state[p] = convert(saved_state, p, group_of[id(p)])
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            raise ValueError(f"state of parameter {pid!r}: {e}") from e
    return new_groups, new_state


def _saved_format(src: dict, name: str, fmt: MomentFormat | None) -> MomentFormat | None:
    """The format saved moment `name` is in: FP8 codes say theirs (None: read by dtype); 4-bit
    codes (uint8) are in the group's 4-bit format, which must be one."""
    if src[name + CODES].dtype != torch.uint8:
        return None
    if fmt is None or fmt.bits != 4:
        raise ValueError(
            f"state {name}_codes holds 4-bit codes but its param group stores {name} as "
            f"{'float32' if fmt is None else fmt.fmt.value}: load it into an optimizer built with "
            "the checkpoint's formats, or convert the checkpoint (coatstate convert)"
        )
    return fmt


def convert_param_state(
    saved: dict,
    p: torch.Tensor,
    group: dict,
    moments: tuple[str, ...] = MOMENTS,
    required: tuple[str, ...] = ("step", "exp_avg", "exp_avg_sq"),
    reference: str = "AdamW",
) -> dict:
    """One parameter's saved state, in this group's format for `p`, on p's device. `moments`: the
    optimizer's; `required`: what a saved state must hold (a `step` not required starts at 0)."""
    if not isinstance(saved, dict):
        raise TypeError(f"a parameter's state must be a dict; got {type(saved).__name__}")
    missing = [k for k in required if k not in saved and k + CODES not in saved]
    foreign = [k for k in ALL_MOMENTS if k not in moments and (k in saved or k + CODES in saved)]
    if missing:
        raise ValueError(
            f"it has keys {sorted(map(str, saved))[:6]} but lacks {reference}'s {missing}: is it another "
            "optimizer's state?"
        )
    if foreign:
        raise ValueError(
            f"it holds {foreign}, which {reference} does not keep: is it another optimizer's state?"
        )
    for key, value in saved.items():
        if isinstance(key, str) and key.startswith(moments) and not isinstance(value, torch.Tensor):
            raise TypeError(f"state {key!r} must be a tensor; got {type(value).__name__}")
    local = local_tensor(p)
    formats = moment_formats(group, global_shape(p), moments)
    saved_group_size = group.get("group_size", DEFAULT_GROUP_SIZE)
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "step":
            step = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            on_device = local.is_cuda and group.get("fused") is not False
            out["step"] = (
                step.detach().to(dtype=torch.float32, device=local.device if on_device else "cpu").clone()
            )
    for name in moments:
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
        saved_format = _saved_format(src, name, formats[name]) if is_compressed(src, name) else None
        expected = saved_format.codes_shape(local.shape) if saved_format is not None else tuple(local.shape)
        if is_compressed(src, name) and tuple(src[name + CODES].shape) != tuple(expected):
            raise ValueError(
                f"state {name}_codes has shape {tuple(src[name + CODES].shape)} but its parameter has "
                f"shape {tuple(local.shape)} (codes of shape {tuple(expected)})"
            )
        init_moment(out, name, local, formats[name])
        if formats[name] is None:
            shape = tuple(local.shape)
            out[name].copy_(read_moment(src, name, saved_group_size, saved_format, shape).float())
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
            else:  # (decoded only here: a load in the same format moves no float32 copy)
                value = read_moment(src, name, saved_group_size, saved_format, tuple(local.shape))
                write_moment(out, name, value.float(), formats[name])
    _convert_master_correction(saved, out, p, group, local)
    if "step" not in out and "step" not in required:  # (torch's SGD and Muon count no steps)
        out["step"] = torch.tensor(0.0)
    if "step" not in out:
        raise ValueError("parameter state has no 'step'")
    if is_dtensor(p):
        if any(is_compressed(out, name) for name in moments):
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


def _format_kwargs(kwargs: dict[str, Any], defaults: Mapping[str, Any] = FORMAT_DEFAULTS) -> dict[str, Any]:
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"unknown format option(s) {sorted(unknown)}; allowed: {sorted(defaults)}")
    options = {**defaults, **kwargs}
    if options["master_bits"] == "auto":  # a torch state names no parameter dtypes to decide from
        options["master_bits"] = None
    for moment in OPTION_MOMENTS:  # one spelling, "auto" resolved: state dicts hold bools
        if format_option(moment) not in options:
            continue
        fmt = parse_format(options[format_option(moment)])
        options[format_option(moment)] = fmt.value
        options[expand_option(moment)] = resolve_expand(fmt, options[expand_option(moment)])
        check_moment_format(moment, fmt, options[expand_option(moment)])
    return options


OPTION_MOMENTS = ("exp_avg", "exp_avg_sq", MOMENTUM)
"""the moments with a format option of their own, any optimizer's"""
OPTION_TABLES = {
    "AdamW": OPTIMIZER_DEFAULTS,
    "SGD": MOMENTUM_DEFAULTS,
    "Muon": MOMENTUM_DEFAULTS,
    "Lion": LION_DEFAULTS,
}
"""each reference's compressed class's own options (formats.defaults)"""


def compress_adamw_state_dict(state_dict: dict[str, Any], **format_options: Any) -> dict[str, Any]:
    """A torch.optim.AdamW state dict -> a CompressedAdamW one (format options as its constructor's)."""
    return compress_state_dict(state_dict, "AdamW", **format_options)


def compress_state_dict(
    state_dict: dict[str, Any], reference: str | None = None, **format_options: Any
) -> dict[str, Any]:
    """A reference optimizer's state dict -> its compressed class's ("AdamW", "SGD", "Muon" or
    "Lion"; None: recognised from the param groups' keys); format options as that class's
    constructor takes them (options of the other classes are left out)."""
    if reference not in (None, *OPTION_TABLES):
        raise ValueError(f"reference must be one of {sorted(OPTION_TABLES)} or None; got {reference!r}")
    table = OPTION_TABLES.get(reference)
    if reference is None:
        kind = kind_of(None, (state_dict.get("param_groups") or [{}])[0])
        reference = kind.reference if kind is not None else _reference_of_moments(state_dict)
        table = OPTION_TABLES[reference]
        format_options = {k: v for k, v in format_options.items() if k in table}
    options = _format_kwargs(format_options, table)
    moments = kind_of(reference).moments
    groups, state = [], {}
    for saved in state_dict["param_groups"]:
        group = {**saved, **options}
        groups.append(group)
        for pid in saved["params"]:
            if pid not in state_dict["state"]:
                continue
            s = state_dict["state"][pid]
            shape = next((s[m].shape for m in moments if m in s), None)
            step = s.get("step", 0.0)
            out = {"step": step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))}
            formats = moment_formats(group, shape, moments) if shape is not None else {}
            for name in moments:
                if name in s:
                    init_moment(out, name, s[name], formats[name])
                    write_moment(out, name, s[name].float(), formats[name])
            state[pid] = out
    return {"state": state, "param_groups": groups}


def _reference_of_moments(state_dict: dict[str, Any]) -> str:
    """The reference whose moments a state dict holds, for groups whose keys mark none (AdamW's,
    as before there were others, when it holds none either)."""
    names = {k for s in state_dict.get("state", {}).values() if isinstance(s, dict) for k in s}
    if MOMENTUM in names:
        return "SGD"
    return "Lion" if "exp_avg" in names and "exp_avg_sq" not in names else "AdamW"


def to_reference_state_dict(
    state_dict: dict[str, Any], shapes: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """A compressed optimizer's state dict -> one its torch reference loads (torch.optim.AdamW,
    SGD, Muon; Lion's plain float32 form): moments decompressed to fp32, coatstate's options
    left out. 4-bit moments' packed codes do not record their parameter's shape: pass `shapes`
    ({param id: shape}; a checkpoint's header lists them) for those."""
    groups, state = [], {}
    for saved in state_dict["param_groups"]:
        groups.append({k: v for k, v in saved.items() if k not in _ALL_OPTIONS})
        g = saved.get("group_size", DEFAULT_GROUP_SIZE)
        for pid in saved["params"]:
            if pid not in state_dict["state"]:
                continue
            s = state_dict["state"][pid]
            out = {"step": s["step"]} if "step" in s else {}
            for name in ALL_MOMENTS:
                if name in s or name + CODES in s:
                    fmt, shape = _four_bit(s, name, saved, g, shapes, pid)
                    out[name] = read_moment(s, name, g, fmt, shape).float().clone()
            state[pid] = out
    return {"state": state, "param_groups": groups}


to_adamw_state_dict = to_reference_state_dict
"""A CompressedAdamW state dict -> one torch.optim.AdamW loads (to_reference_state_dict)."""
_ALL_OPTIONS = frozenset(OPTIMIZER_DEFAULTS) | frozenset(MOMENTUM_DEFAULTS)


def _four_bit(s: dict, name: str, group: dict, group_size: int, shapes, pid) -> tuple:
    """(MomentFormat, shape) to read a 4-bit moment with; (None, None) for any other."""
    if name + CODES not in s or s[name + CODES].dtype != torch.uint8:
        return None, None
    shape = (shapes or {}).get(pid)
    if shape is None:
        raise ValueError(
            f"param {pid}: {name} is in 4 bits, whose packed codes do not record the parameter's "
            "shape; pass shapes={param id: shape} (a checkpoint's header has them)"
        )
    fmt = parse_format(group.get(format_option(name)))
    return MomentFormat(fmt, False, group_size), tuple(shape)


def _convert_master_correction(
    saved: dict, out: dict, p: torch.Tensor, group: dict, local: torch.Tensor
) -> None:
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
