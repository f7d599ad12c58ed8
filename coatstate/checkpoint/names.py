"""Parameters and model entries matched by name when a checkpoint is loaded.

A checkpoint records every parameter's name (from `model=` or torch's `param_names`), and `load`
knows the loading optimizer's. Two parameters of one shape in another order would otherwise
swap their moments silently; `by_name` reorders the file's state to the optimizer's order, or
refuses naming what differs. torch.compile wraps a model, so its keys gain `_orig_mod.`:
`model_keys` accepts a checkpoint of the compiled model in the plain one, and the other way round.
`check_header_first` compares the shapes a header records with the optimizer and model before a
tensor is read: a small zstd file that claims huge tensors is refused before it is decompressed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError

COMPILED_PREFIX = "_orig_mod."
"""What torch.compile's OptimizedModule puts before every name of the module it wraps."""


def plain(name: str) -> str:
    """`name` without torch.compile's wrapper segments (at any depth: a compiled submodule too)."""
    return name.replace(COMPILED_PREFIX, "")


def optimizer_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> dict[int, str]:
    """{flat param index: name} of `optimizer`'s parameters, from `model` or, without it, from
    the groups' `param_names` (an optimizer built from named_parameters())."""
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        by_obj = {id(p): n for n, p in model.named_parameters()}
        return {i: by_obj[id(p)] for i, p in enumerate(flat) if id(p) in by_obj}
    names: dict[int, str] = {}
    i = 0
    for group in optimizer.param_groups:
        group_names = group.get("param_names")
        for k in range(len(group["params"])):
            if isinstance(group_names, list) and k < len(group_names) and isinstance(group_names[k], str):
                names[i] = group_names[k]
            i += 1
    return names


def _file_names(ckpt, ids: list) -> dict[Any, str]:
    params = ckpt.header.get("params") or {}
    out: dict[Any, str] = {}
    for group in ckpt.optimizer["param_groups"]:
        group_names = group.get("param_names")
        for k, pid in enumerate(group["params"]):
            recorded = (params.get(str(pid)) or {}).get("name")
            if isinstance(recorded, str):
                out[pid] = recorded
            elif isinstance(group_names, list) and k < len(group_names) and isinstance(group_names[k], str):
                out[pid] = group_names[k]
            elif isinstance(pid, str):  # a state dict keyed by name (get_optimizer_state_dict's)
                out[pid] = pid
    return out if len(out) == len(ids) else {}


def by_name(ckpt, optimizer: torch.optim.Optimizer, names: Mapping[int, str], where: str):
    """`ckpt` with its parameters in `optimizer`'s order, matched by name where both sides name
    every parameter (else as it is: matched by position, as before names were known)."""
    file_groups = ckpt.optimizer["param_groups"]
    ids = [pid for g in file_groups for pid in g["params"]]
    counts = [len(g["params"]) for g in optimizer.param_groups]
    theirs = _file_names(ckpt, ids)
    if not theirs or len(names) != sum(counts) or len(ids) != sum(counts):
        return ckpt
    ours = [plain(names[i]) for i in range(len(names))]
    file_order = [plain(theirs[pid]) for pid in ids]
    if file_order == ours and all(isinstance(pid, int) for pid in ids):
        return ckpt
    if len(set(ours)) != len(ours) or len(set(file_order)) != len(file_order):
        return ckpt  # (one name twice: a tied weight listed twice; position is all there is)
    if set(ours) != set(file_order):
        only_file = [n for n in file_order if n not in set(ours)]
        only_ours = [n for n in ours if n not in set(file_order)]
        raise CheckpointError(
            f"{where}: the optimizer's parameters are not the checkpoint's: {len(only_file)} named only "
            f"in the file {only_file[:3]}, {len(only_ours)} only in the optimizer {only_ours[:3]}. Loading "
            "by position would give one parameter's moments to another. If only their names changed, "
            "load without model= into an optimizer built from model.parameters() (matched by position)"
        )
    if len(file_groups) != len(optimizer.param_groups):
        return ckpt  # (check_optimizer names the group counts)
    pid_of = dict(zip(file_order, ids, strict=True))
    group_of = {pid: g for g, group in enumerate(file_groups) for pid in group["params"]}
    params = ckpt.header.get("params") or {}
    state, groups, header_params = {}, [], {}
    index = 0
    for g, count in enumerate(counts):
        group = dict(file_groups[g])
        group["params"] = list(range(index, index + count))
        picked = []
        for i in group["params"]:
            pid = pid_of[ours[i]]
            if group_of[pid] != g:
                raise CheckpointError(
                    f"{where}: parameter {names[i]} is in param group {g} of the optimizer but in group "
                    f"{group_of[pid]} of the checkpoint; build the optimizer's groups as the saved ones"
                )
            picked.append(pid)
            if pid in ckpt.optimizer["state"]:
                state[i] = ckpt.optimizer["state"][pid]
            header_params[str(i)] = dict(params.get(str(pid)) or {}, group=g, name=theirs[pid])
        if isinstance(group.get("param_names"), list):
            group["param_names"] = [theirs[pid] for pid in picked]
        groups.append(group)
        index += count
    header = dict(ckpt.header, params=header_params) if ckpt.header else ckpt.header
    return dataclasses.replace(ckpt, optimizer={"state": state, "param_groups": groups}, header=header)


def model_keys(ckpt, model: torch.nn.Module, where: str):
    """`ckpt` with its model entries under `model`'s keys where they differ only by
    torch.compile's `_orig_mod.` (a compiled model's checkpoint into the plain model, or back)."""
    saved = ckpt.model
    if saved is None:
        return ckpt
    current = list(model.state_dict())
    if set(current) == set(saved):
        return ckpt
    by_plain = {plain(k): k for k in current}
    if len(by_plain) != len(current) or {plain(k) for k in saved} != set(by_plain) or len(saved) != len(
        current
    ):
        return ckpt  # (check_model names the keys that differ)
    return dataclasses.replace(ckpt, model={by_plain[plain(k)]: t for k, t in saved.items()})


def check_header_first(header: Mapping[str, Any], optimizer, model, names: Mapping[int, str], where: str):
    """Refuse a checkpoint whose header (parameter counts, recorded shapes, model tensor shapes)
    does not fit `optimizer` and `model`, before any tensor is read or decompressed. Parameters
    pair by name where both sides name them all (as `by_name` loads them), else by position."""
    ids = [pid for g in header["param_groups"] for pid in g["params"]]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    theirs_counts = [len(g["params"]) for g in header["param_groups"]]
    ours_counts = [len(g["params"]) for g in optimizer.param_groups]
    if theirs_counts != ours_counts:  # (validate.check_optimizer's words)
        raise CheckpointError(
            f"{where}: the file has {len(theirs_counts)} param group(s) with {theirs_counts} params; the "
            f"optimizer has {len(ours_counts)} with {ours_counts}"
        )
    recorded = {pid: header["params"][str(pid)] for pid in ids}
    theirs = [plain(recorded[pid].get("name") or "") for pid in ids]
    ours = [plain(names.get(i, "")) for i in range(len(flat))]
    pairs = list(zip(ids, range(len(flat)), strict=True))
    if all(theirs) and all(ours) and len(set(theirs)) == len(ids) and set(theirs) == set(ours):
        index = {n: i for i, n in enumerate(ours)}
        pairs = [(pid, index[n]) for pid, n in zip(ids, theirs, strict=True)]
    for pid, i in pairs:
        shape = recorded[pid].get("shape")
        if shape is not None and list(shape) != list(flat[i].shape):
            name = recorded[pid].get("name") or names.get(i) or f"#{i}"
            raise CheckpointError(
                f"{where}: parameter {name} (index {i}) has shape {list(flat[i].shape)} in the optimizer "
                f"but {shape} in the checkpoint"
            )
    if model is None or header.get("model") is None:
        return
    current = {plain(k): list(t.shape) for k, t in model.state_dict().items()}
    for name in header["model"]:
        shape = header["tensors"][schema.model_key(name)]["shape"]
        if plain(name) in current and current[plain(name)] != shape:
            raise CheckpointError(
                f"{where}: model tensor {name} has shape {current[plain(name)]} in the model but {shape} "
                "in the checkpoint"
            )
