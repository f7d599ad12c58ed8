"""Checks of the values a read checkpoint holds, before `load` changes anything.

The header checks (validate.py) see dtypes and shapes only. A step of -5 or NaN, a NaN or
negative scale, or an expansion exponent code of 0 (k = 0 divides by zero) passes them, loads,
and then fails the first step or turns the weights NaN. These are cheap reductions over the
small tensors (steps, scales, exponents); the codes and float moments are not read (a NaN code
is how a non-finite moment is stored on purpose).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from coatstate import distributed as dtensors
from coatstate.formats.group import MIN_EXPONENT_CODE
from coatstate.formats.optimizer_state import EXPONENTS, MOMENTS, SCALES
from coatstate.formats.schema import CheckpointError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if dtensors.is_dtensor(t) else t


def _check_step(step: Any, where: str) -> None:
    if isinstance(step, torch.Tensor):
        step = _local(step)
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            raise CheckpointError(
                f"{where}.step must be a one-element number tensor; got {step.dtype} {list(step.shape)}"
            )
        value = float(step.reshape(-1)[0])
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise CheckpointError(f"{where}.step must be a number or a one-element tensor; got {step!r:.40}")
    if not (math.isfinite(value) and value >= 0):
        raise CheckpointError(f"{where}.step is {value}; a step count is finite and >= 0 (a corrupt file)")


def check_values(sd: Mapping[str, Any], where: str) -> None:
    """Steps finite and >= 0 (one element), scales finite and >= 0, exponent codes >= 1; else a
    CheckpointError naming the parameter and the tensor."""
    for pid, state in sd["state"].items():
        at = f"{where}: state[{pid}]"
        if "step" in state:
            _check_step(state["step"], at)
        for m in MOMENTS:
            scales = state.get(m + SCALES)
            if isinstance(scales, torch.Tensor) and scales.is_floating_point():
                s = _local(scales)
                if s.numel() and not bool((torch.isfinite(s) & (s >= 0)).all()):
                    raise CheckpointError(
                        f"{at}.{m}{SCALES} holds NaN, infinite or negative scales (a scale is the "
                        "finite, non-negative size of its group): the file is corrupt"
                    )
            exponents = state.get(m + EXPONENTS)
            if isinstance(exponents, torch.Tensor):
                e = _local(exponents)
                if e.numel() and int(e.min()) < MIN_EXPONENT_CODE:
                    raise CheckpointError(
                        f"{at}.{m}{EXPONENTS} holds the code {int(e.min())}; expansion codes are "
                        f"{MIN_EXPONENT_CODE} to 255 (16 * k, k > 0): the file is corrupt"
                    )


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share memory (an expand()ed tensor: a stride of 0), which a
    copy into it refuses. Dims by ascending stride: each must step past all the smaller ones."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_model_writable(model: torch.nn.Module, where: str) -> None:
    """Refuse, before anything is loaded, a model whose load_state_dict would fail partway: a
    tensor whose elements share memory (copy_ into it raises after the tensors before it were
    copied, leaving the model half-loaded)."""
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and _overlaps(_local(t)):
            raise CheckpointError(
                f"{where}: model tensor {name} is expanded (its elements share memory, strides "
                f"{list(_local(t).stride())}), so load_state_dict cannot copy into it; nothing was loaded. "
                f"Give the module its own copy first (e.g. register_buffer({name.rsplit('.', 1)[-1]!r}, "
                "tensor.clone())), or register it with persistent=False"
            )
