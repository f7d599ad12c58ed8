"""torch.save files: read with weights_only=True, and the optimizer state dict found inside the
common training-checkpoint layout `torch.save({"model": ..., "optimizer": ..., "step": ...})`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from coatstate.checkpoint import encoding, validate
from coatstate.checkpoint.dcp import load_failure, weights_only_load
from coatstate.formats.schema import CheckpointError

PT_EXTENSIONS = (".pt", ".pth", ".bin")
"""Read as torch.save files whatever their first bytes (others by their magic)."""
MODEL_KEYS = ("model", "model_state_dict", "state_dict")
"""Entries of a training checkpoint that hold the model's state dict (taken when all tensors)."""


def _is_optimizer(v: Any) -> bool:
    return isinstance(v, Mapping) and "state" in v and "param_groups" in v


def _model_of(obj: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    for key in MODEL_KEYS:
        v = obj.get(key)
        if isinstance(v, Mapping) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
            return dict(v)
    return None


def entry(obj: Any, where: str, key: str | None) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """(the optimizer state dict, the model state dict or None) of a loaded torch.save object:
    the object itself, its entry `key`, or its one entry that is an optimizer state dict."""
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            keys = sorted(map(str, obj))[:20] if isinstance(obj, Mapping) else type(obj).__name__
            raise CheckpointError(f"{where}: has no entry {key!r}; its keys: {keys}")
        return obj[key], _model_of(obj)
    if not isinstance(obj, Mapping) or _is_optimizer(obj):
        return obj, None
    found = [k for k, v in obj.items() if _is_optimizer(v)]
    if len(found) == 1:
        return obj[found[0]], _model_of(obj)
    keys = sorted(map(str, obj))[:20]
    what = f"{len(found)} optimizer state dicts ({found[:5]})" if found else "no optimizer state dict"
    raise CheckpointError(
        f"{where}: not an optimizer state dict, and its entries hold {what}: its keys are {keys}. "
        "Name the entry that holds it (`coatstate convert SRC DST --key optimizer`, or "
        "coatstate.read(url, key='optimizer'))"
    )


def read_pt(data: bytes, where: str, key: str | None = None) -> tuple[dict[str, Any], dict | None]:
    """(optimizer state dict, model state dict or None) of the torch.save file in `data`."""
    ext = os.path.splitext(where)[1].lower()
    why = f"because of its extension {ext}" if ext in PT_EXTENSIONS else "because it starts like a zip file"
    try:
        obj = weights_only_load(data)
    except Exception as e:  # weights_only refuses anything that would need unpickling code
        reason = load_failure(e)
        if data[:2] != b"PK" and data[:1] != b"\x80":  # neither a zip nor a pickle's protocol opcode
            reason = f"it is neither a zip archive (torch.save's format) nor a pickle ({reason})"
        raise CheckpointError(
            f"{where}: not a readable torch.save file (read as one {why}, with weights_only=True): {reason}"
        ) from None
    optimizer, model = entry(obj, where, key)
    optimizer = validate.check_state_dict(optimizer, where)
    tensors = [(f"state[{p}].{n}", v) for p, s in optimizer["state"].items() for n, v in s.items()]
    groups = enumerate(optimizer["param_groups"])
    tensors += [(f"param_groups[{g}].{k}", v) for g, group in groups for k, v in group.items()]
    tensors += [(f"model entry {n!r}", v) for n, v in (model or {}).items()]
    for what, t in tensors:
        problem = isinstance(t, torch.Tensor) and encoding.dense_problem(t)
        if problem:
            raise CheckpointError(f"{where}: {what} is {problem}")
    return optimizer, model
