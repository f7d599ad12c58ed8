"""CompressedSGD's, CompressedLion's and CompressedMuon's hyperparameter checks: the constructor's
(their references' checks and messages), and every param group's when it is added or loaded,
so that a bad value fails there rather than at the first step."""

from __future__ import annotations

from typing import Any

import torch

from coatstate.optim.options import check_lr, check_options

MUON_ADJUST_LR = (None, "original", "match_rms_adamw")
"""torch.optim.Muon's adjust_lr_fn values"""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_lr_argument(lr: Any, message: str) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    elif not _number(lr):
        raise TypeError(f"lr must be a number; got {type(lr).__name__} {lr!r:.40}: pass lr=<a float>")
    elif not lr >= 0.0:
        raise ValueError(message.format(lr))


def _check_unsupported(differentiable: bool, name: str) -> None:
    if differentiable:
        raise ValueError(
            f"{name} does not support differentiable=True: its momentum is requantized in place "
            "each step; use the torch optimizer for that mode"
        )


def check_sgd_arguments(lr, momentum, dampening, weight_decay, nesterov, differentiable) -> None:
    """torch.optim.SGD's validation, with its messages."""
    _check_lr_argument(lr, "Invalid learning rate: {}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    _check_unsupported(differentiable, "CompressedSGD")


def check_lion_arguments(lr, betas, weight_decay) -> None:
    """Lion's ranges (Chen et al. 2023; lion-pytorch's asserts), with AdamW's message style."""
    _check_lr_argument(lr, "Invalid learning rate: {}")
    if isinstance(betas, torch.Tensor) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(
            f"betas must be a pair of floats (beta1, beta2); got {betas!r:.40}: pass e.g. betas=(0.9, 0.99)"
        )
    for i, b in enumerate(betas):
        if not (_number(b) and 0.0 <= b <= 1.0):
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if not (_number(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_muon_arguments(lr, momentum, weight_decay, adjust_lr_fn) -> None:
    """torch.optim.Muon's validation, with its messages."""
    _check_lr_argument(lr, "Learning rate should be >= 0 but is: {}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in MUON_ADJUST_LR:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def check_muon_params(params: list) -> None:
    """torch.optim.Muon's refusal of parameters that are not matrices (its message)."""
    for p in params:
        if p.ndim != 2:
            raise ValueError(
                f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}; "
                "step biases, norms and embeddings with CompressedAdamW (README, 'Muon')"
            )


def _at_least(gi: int, group: dict, keys: tuple[str, ...], low: float = 0.0) -> None:
    for key in keys:
        v = group[key]
        if not (_number(v) and v >= low) and not (key == "weight_decay" and isinstance(v, torch.Tensor)):
            raise ValueError(f"param group {gi}: {key} must be a number >= {low:g}; got {v!r:.40}")


def _flags(gi: int, group: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(group[key], bool):
            raise ValueError(f"param group {gi}: {key} must be True or False; got {group[key]!r:.40}")


def check_sgd_group(gi: int, group: dict[str, Any]) -> None:
    check_lr(gi, group)
    _at_least(gi, group, ("momentum", "weight_decay"))
    if not _number(group["dampening"]):
        raise ValueError(f"param group {gi}: dampening must be a number; got {group['dampening']!r:.40}")
    _flags(gi, group, ("nesterov", "maximize"))
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(f"param group {gi}: Nesterov momentum requires a momentum and zero dampening")
    check_options(gi, group, ("momentum_buffer",))


def check_lion_group(gi: int, group: dict[str, Any]) -> None:
    check_lr(gi, group)
    betas = group["betas"]
    if not (
        isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(_number(b) and 0 <= b <= 1 for b in betas)
    ):
        raise ValueError(f"param group {gi}: betas must be two floats in [0, 1]; got {betas!r:.60}")
    _at_least(gi, group, ("weight_decay",))
    _flags(gi, group, ("maximize",))
    check_options(gi, group, ("exp_avg",))


def check_muon_group(gi: int, group: dict[str, Any]) -> None:
    check_lr(gi, group)
    _at_least(gi, group, ("momentum", "weight_decay", "eps"))
    _flags(gi, group, ("nesterov",))
    coefficients, steps = group["ns_coefficients"], group["ns_steps"]
    if not (
        isinstance(coefficients, (tuple, list)) and len(coefficients) == 3 and all(map(_number, coefficients))
    ):
        raise ValueError(f"param group {gi}: ns_coefficients must be three numbers; got {coefficients!r:.60}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"param group {gi}: ns_steps must be an int from 0 to 99; got {steps!r:.40}")
    if group["adjust_lr_fn"] not in MUON_ADJUST_LR:
        raise ValueError(
            f"param group {gi}: Adjust learning rate function {group['adjust_lr_fn']} is not supported"
        )
    check_muon_params(group["params"])
    check_options(gi, group, ("momentum_buffer",))
