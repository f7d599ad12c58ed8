"""Between a float32 model and a bfloat16 one with master weights, on state dicts.

split_master turns a float32 model state dict and its optimizer state dict (CompressedAdamW's or
torch.optim.AdamW's) into the bfloat16 weights and master corrections that
`CompressedAdamW(..., master_bits=...)` steps on; join_master is its inverse. With master_bits=32
both directions are exact: weight and int16 remainder are the float32 bits. With 24 the split
rounds the master to 24 bits once and the join gives back exactly the master the optimizer
stood for; with 16 the split rounds to nearest and the join widens the weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from coatstate.formats import master_weights
from coatstate.formats.master_weights import CORRECTION_DTYPES, MASTER_BITS
from coatstate.formats.optimizer_state import MASTER_CORRECTION

_SPLITS = {32: master_weights.split32, 24: master_weights.split24}
_JOINS = {32: master_weights.join32, 24: master_weights.join24}


def _names(optimizer_state: Mapping[str, Any], param_names) -> dict[int, str]:
    """Parameter id -> model state-dict key, from `param_names` or the groups' param_names."""
    if param_names is None:
        pairs = [
            (pid, name)
            for g in optimizer_state["param_groups"]
            for pid, name in zip(g["params"], g.get("param_names") or [], strict=False)
        ]
        names = dict(pairs)
    elif isinstance(param_names, Mapping):
        names = {int(k): v for k, v in param_names.items()}
    else:
        names = dict(enumerate(param_names))
    missing = [pid for g in optimizer_state["param_groups"] for pid in g["params"] if pid not in names]
    if missing:
        raise ValueError(
            f"no model state-dict key for parameter id(s) {missing[:8]}: pass param_names= (the "
            "optimizer's parameters in order, e.g. [n for n, _ in model.named_parameters()]), or "
            "build the optimizer from model.named_parameters() so its groups carry param_names"
        )
    return names


def _check(model_state: Mapping[str, torch.Tensor], names: dict[int, str]) -> None:
    absent = sorted({n for n in names.values() if n not in model_state})
    if absent:
        raise ValueError(f"the model state dict has no {absent[:8]} (named by the optimizer's param_names)")


def split_master(
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    *,
    master_bits: int,
    keep: Sequence[str] | None = None,
    param_names: Sequence[str] | Mapping[int, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(bfloat16 model state dict, optimizer state dict with master corrections) from a float32
    model and its optimizer state.

    Every float32 parameter the optimizer steps becomes bfloat16 except those named in `keep`
    (their own master, e.g. the norms cast_model keeps: `[n for n, p in cast_model(m).named_
    parameters() if p.dtype == torch.float32]`); every param group gets `master_bits`. Buffers and
    parameters the optimizer does not know are copied unchanged. Load the results into
    `cast_model(model)` and `CompressedAdamW(model.parameters(), master_bits=master_bits)`.
    """
    if master_bits not in MASTER_BITS:
        raise ValueError(f"master_bits must be one of {MASTER_BITS}; got {master_bits!r}")
    names = _names(optimizer_state, param_names)
    _check(model_state, names)
    kept = set(keep or ())
    unknown = kept - set(model_state)
    if unknown:
        raise ValueError(f"keep names {sorted(unknown)[:8]}, which the model state dict does not have")
    model_out = dict(model_state)
    state_out = {pid: dict(s) for pid, s in optimizer_state["state"].items()}
    for pid, name in names.items():
        x = model_state[name]
        if name in kept or x.dtype != torch.float32:
            continue
        if master_bits in _SPLITS:
            w, correction = _SPLITS[master_bits](x)
            if pid in state_out:  # a parameter without state gets a zero correction at its first step
                state_out[pid][MASTER_CORRECTION] = correction
        else:
            w = master_weights.round_to_bf16(x)
        model_out[name] = w
    groups = [{**g, "master_bits": master_bits} for g in optimizer_state["param_groups"]]
    return model_out, {"state": state_out, "param_groups": groups}


def join_master(
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    *,
    param_names: Sequence[str] | Mapping[int, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(float32 model state dict, optimizer state dict without master corrections): the inverse
    of split_master. Each bfloat16 parameter becomes the float32 master its weight and correction
    stand for (the weight itself with master_bits=16 or None); the groups' master_bits become None,
    so the result loads into a float32 model with CompressedAdamW or torch.optim.AdamW (after
    to_adamw_state_dict)."""
    names = _names(optimizer_state, param_names)
    _check(model_state, names)
    model_out = dict(model_state)
    state_out = {pid: dict(s) for pid, s in optimizer_state["state"].items()}
    bits_of = {pid: g.get("master_bits") for g in optimizer_state["param_groups"] for pid in g["params"]}
    for pid, name in names.items():
        w = model_state[name]
        if w.dtype not in (torch.bfloat16, torch.float16):
            continue
        correction = state_out.get(pid, {}).pop(MASTER_CORRECTION, None)
        mode = bits_of[pid]
        if correction is None or mode not in _JOINS:
            model_out[name] = w.float()
            continue
        if correction.dtype != CORRECTION_DTYPES[mode] or correction.shape != w.shape:
            raise ValueError(
                f"{name}: its master correction is {correction.dtype} {tuple(correction.shape)}, but "
                f"master_bits={mode} on a {tuple(w.shape)} weight needs {CORRECTION_DTYPES[mode]}"
            )
        model_out[name] = _JOINS[mode](w, correction)
    groups = [{**g, "master_bits": None} for g in optimizer_state["param_groups"]]
    return model_out, {"state": state_out, "param_groups": groups}
