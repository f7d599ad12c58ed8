"""CompressedAdamW's arguments and param-group options, checked where they arrive: the
constructor's (torch.optim.AdamW's checks and messages), and every param group's when it is added
or loaded, so that a bad option fails there rather than at the first step."""

from __future__ import annotations

import logging
from typing import Any

import torch

from coatstate.formats.defaults import MAX_GROUP_SIZE
from coatstate.formats.master_weights import MASTER_BITS
from coatstate.formats.optimizer_state import (
    MomentFormat,
    check_moment_format,
    expand_option,
    format_option,
    parse_format,
    resolve_expand,
)

logger = logging.getLogger("coatstate")
MOMENTS_WITH_OPTIONS = ("exp_avg", "exp_avg_sq")
"""the moments with a format option of their own (max_exp_avg_sq shares exp_avg_sq's)"""


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
    if group["group_size"] > MAX_GROUP_SIZE:
        raise ValueError(
            f"param group {gi}: group_size must be at most {MAX_GROUP_SIZE}; got {group['group_size']!r:.40}"
        )
    for key in ("exp_avg_format", "exp_avg_sq_format"):  # first: a bad format leaves expand "auto"
        try:
            parse_format(group[key])
        except (ValueError, TypeError) as e:
            raise ValueError(f"param group {gi}: {key}: {e}") from None
    for key in ("compress", "exp_avg_expand", "exp_avg_sq_expand", "compress_1d"):
        if not isinstance(group[key], bool):
            raise ValueError(f"param group {gi}: {key} must be True or False; got {group[key]!r:.40}")
    if isinstance(group["master_bits"], bool) or group["master_bits"] not in (None, *MASTER_BITS):
        raise ValueError(
            f"param group {gi}: master_bits must be None, 16, 24 or 32; got {group['master_bits']!r:.40}"
        )
    for moment in MOMENTS_WITH_OPTIONS:
        key, expand = format_option(moment), group[expand_option(moment)]
        try:
            fmt = parse_format(group[key])
            check_moment_format(moment, fmt, expand)
            MomentFormat(fmt, expand, group["group_size"])  # (its own rules: 4-bit needs an even group)
        except (ValueError, TypeError) as e:
            raise ValueError(f"param group {gi}: {key}: {e}") from None


def settle_group(gi: int, group: dict) -> None:
    """Resolve a new param group's master_bits="auto" and check all its options: a bad option
    fails here, when the group is added, not at the first step."""
    check_params(gi, group["params"])
    dtypes = {p.dtype for p in group["params"]}
    if group.get("master_bits") == "auto":  # resolved here: state dicts and checkpoints hold ints
        group["master_bits"] = 24 if torch.bfloat16 in dtypes and torch.float16 not in dtypes else None
    if group.get("master_bits") is not None and group["master_bits"] not in MASTER_BITS:
        raise ValueError(f"master_bits must be 'auto', None, 16, 24 or 32; got {group['master_bits']!r}")
    if group.get("master_bits") is not None and torch.float16 in dtypes:
        raise ValueError(
            "master_bits is for bfloat16 parameters (a float16 value is not the top half of a "
            "float32 one); cast the model with coatstate.cast_model(model, torch.bfloat16), or "
            "keep float16 parameters with master_bits=None"
        )
    for moment in MOMENTS_WITH_OPTIONS:  # one spelling in state dicts and launches
        key, expand = format_option(moment), expand_option(moment)
        try:
            fmt = parse_format(group[key])
        except (ValueError, TypeError):
            continue  # check_group names the group and the option
        group[key] = fmt.value
        group[expand] = resolve_expand(fmt, group.get(expand, "auto"))  # state dicts hold bools
    check_group(gi, group)
    if group.get("master_bits") is None and dtypes & {torch.bfloat16, torch.float16}:
        logger.info(
            "coatstate: 16-bit parameters without master_bits: each update rounds to the "
            "parameter's precision (small updates can vanish); master_bits=24 or 32 keeps a "
            "master correction, 16 rounds stochastically"
        )


def _check_types(lr, betas, eps, weight_decay) -> None:
    """Types first: a string lr ('3e-4' from a config file) or a single beta would otherwise fail
    deep inside a comparison with a TypeError that names neither the argument nor the fix."""
    for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (_number(v) or (name == "lr" and isinstance(v, torch.Tensor))):
            fix = f"{name}={float(v)!r}" if isinstance(v, str) and _parses(v) else f"{name}=<a float>"
            raise TypeError(f"{name} must be a number; got {type(v).__name__} {v!r:.40}: pass {fix}")
    if isinstance(betas, torch.Tensor) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(
            f"betas must be a pair of floats (beta1, beta2); got {type(betas).__name__} {betas!r:.40}: "
            "pass e.g. betas=(0.9, 0.999)"
        )
    for i, b in enumerate(betas):
        if not (_number(b) or isinstance(b, torch.Tensor)):
            raise TypeError(f"betas[{i}] must be a float; got {type(b).__name__} {b!r:.40}")


def _parses(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_params(gi: int, params: list) -> None:
    """Only floating-point tensors have an AdamW update; an integer one would be stepped as if its
    values were weights (or fail in a cast), so it is refused when its group is added."""
    for i, p in enumerate(params):
        if not (p.is_floating_point() or p.is_complex()):  # complex: refused at the step, with its own fix
            raise TypeError(
                f"param group {gi}: parameter {i} is a {p.dtype} tensor of shape {tuple(p.shape)}; "
                "CompressedAdamW steps floating-point parameters only: leave it out (e.g. "
                "[p for p in model.parameters() if p.is_floating_point()]) or register it as a buffer"
            )


def check_arguments(lr, betas, eps, weight_decay, unsupported_mode, group_size, formats) -> None:
    """torch.optim.AdamW's validation (same messages), plus coatstate's format options."""
    _check_types(lr, betas, eps, weight_decay)
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element; got shape {tuple(lr.shape)}")
    elif not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor):
            raise ValueError("tensor betas are not supported by CompressedAdamW; pass floats")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if unsupported_mode:
        raise ValueError(
            "CompressedAdamW does not support capturable=True or differentiable=True: its "
            "states are requantized in place each step; use torch.optim.AdamW for those modes"
        )
    if isinstance(group_size, bool) or not (isinstance(group_size, int) and 0 < group_size <= MAX_GROUP_SIZE):
        raise ValueError(f"group_size must be an int from 1 to {MAX_GROUP_SIZE}; got {group_size!r}")
    for name, value in zip(("exp_avg_format", "exp_avg_sq_format"), formats, strict=True):
        try:
            parse_format(value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def check_master_arguments(master_seed, gradient_release, max_grad_norm) -> None:
    # (master_bits is checked per param group, in add_param_group, which also sees overrides)
    if not isinstance(master_seed, int):
        raise TypeError(f"master_seed must be an int; got {type(master_seed).__name__}")
    if max_grad_norm is not None and not gradient_release:
        raise ValueError(
            "max_grad_norm is for gradient_release=True; without release, clip as usual with "
            "torch.nn.utils.clip_grad_norm_ before opt.step()"
        )
