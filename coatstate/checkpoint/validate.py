"""Checks of a checkpoint before anything is built from it, and before it is loaded.

`validate_header` checks a header against its schema (docs/CHECKPOINT.md) from the header alone:
field types and ranges, the tagged values, which tensors the entries name, and that every moment
agrees with its parameter's shape and with its group format (a `group_size` that disagrees with
the stored scales would requantize the moments silently). A header that a buggy writer produced
with a valid checksum is refused here with a CheckpointError, never a TypeError deeper down.
`check_*` compare a read checkpoint with the optimizer and model it is about to be loaded into.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from coatstate.checkpoint import extra as run_state
from coatstate.formats import optimizer_schema, schema
from coatstate.formats.defaults import MAX_GROUP_SIZE
from coatstate.formats.group import group_layout
from coatstate.formats.optimizer_state import (
    ALL_MOMENTS,
    CODES,
    DEFAULT_GROUP_SIZE,
    EXPONENTS,
    FIRST_MOMENTS,
    SCALES,
)
from coatstate.formats.schema import CheckpointError

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FP8_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_FP4_FORMATS = {"e2m1": "exp_avg", "ue3m1_sqrt": "exp_avg_sq"}
"""4-bit moment formats (codes: packed uint8 (rows, ceil(cols / 2))) and the moment each is for
(e2m1: every signed moment, formats.optimizer_state.FIRST_MOMENTS)"""
_FORMATS = {**_FP8_DTYPES, **dict.fromkeys(_FP4_FORMATS, "uint8")}
_BOOL_KEYS = ("compress", "compress_1d", "exp_avg_expand", "exp_avg_sq_expand", "momentum_expand")
"""coatstate's own flags, wherever they are (an optimizer's own: formats.optimizer_schema)"""
_FORMAT_KEYS = ("exp_avg_format", "exp_avg_sq_format", "momentum_format")
MAX_DIMS = 64
"""More dimensions than any torch tensor has (torch's own limit)."""


class _Ref:
    """A {"$tensor": key} reference, decoded for checking."""

    def __init__(self, key: str):
        self.key = key


class _Tensor:
    """A state tensor as the header describes it."""

    def __init__(self, dtype: str, shape: list[int]):
        self.dtype, self.shape = dtype, shape


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(v: Any, where: str, fail) -> Any:
    """A tagged JSON value decoded with tensors as _Ref; bad tags fail (depth is bounded already)."""
    if isinstance(v, list):
        return [_plain(x, where, fail) for x in v]
    if isinstance(v, dict):
        problem = schema.tag_problem(v)
        if problem:
            fail(f"{where}: {problem}")
        if "$tuple" in v:
            return tuple(_plain(x, where, fail) for x in v["$tuple"])
        if "$float" in v:
            return float(v["$float"])
        if "$items" in v:
            return [(k, _plain(x, where, fail)) for k, x in v["$items"]]
        if "$tensor" in v:
            return _Ref(v["$tensor"])
        return {k: _plain(x, f"{where}.{k}", fail) for k, x in v.items()}
    return v


def _shape(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_DIMS and all(_is_int(s) and s >= 0 for s in v)


def validate_header(header: Any, where: str) -> dict[str, Any]:
    """The header, or a CheckpointError naming `where`, the field and the problem."""

    def fail(problem: str):
        raise CheckpointError(f"{where}: invalid header: {problem}")

    schema.check_header(header, where)
    opt = header.get("optimizer")
    if opt is not None:
        if not isinstance(opt, dict) or not isinstance(opt.get("class"), (str, type(None))):
            fail("optimizer must be {'class': str or null, 'variant': ...}")
        if opt.get("variant") not in (None, "compressed", "full"):
            fail(f"optimizer.variant must be 'compressed' or 'full'; got {opt.get('variant')!r:.40}")
    if not isinstance(header.get("library_version"), (str, type(None))):
        fail(f"library_version must be a string or null; got {header.get('library_version')!r:.40}")
    if header.get("created_unix") is not None and not _is_num(header["created_unix"]):
        fail(f"created_unix must be a number or null; got {header.get('created_unix')!r:.40}")
    if header.get("checksum", schema.CHECKSUM_ALGORITHM) not in (schema.CHECKSUM_ALGORITHM, None):
        fail(f"checksum must be {schema.CHECKSUM_ALGORITHM!r} (or null in a per-rank checkpoint)")
    if header.get("compression") not in (None, "zstd"):
        fail(f"compression must be null or 'zstd'; got {header.get('compression')!r:.40}")
    # a per-rank (DCP) header has checksum null: DCP stores no tensor checksums
    tensors = _tensors(header["tensors"], fail, header.get("checksum") is not None)
    referenced: dict[str, str] = {}

    def ref(key: str, expected: str, what: str):
        if key != expected:
            fail(f"{what} names tensor {key!r:.80}; its tensor is {expected!r}")
        if key not in tensors:
            fail(f"{what} names tensor {key!r:.80}, which the header's 'tensors' does not list")
        referenced[key] = what
        return tensors[key]

    saved_class = (opt or {}).get("class")
    group_of = _param_groups(header["param_groups"], fail, ref, saved_class)
    group_sizes = [g.get("group_size", DEFAULT_GROUP_SIZE) for g in header["param_groups"]]
    params = header["params"]
    if set(params) != {str(pid) for pid in group_of}:
        extra = sorted(set(params) - {str(p) for p in group_of})[:5]
        missing = sorted({str(p) for p in group_of} - set(params))[:5]
        fail(f"params must list exactly the param ids of param_groups (extra {extra}, missing {missing})")
    _check_params(params, group_of, group_sizes, fail)
    _check_state(header["state"], params, group_sizes, ref, fail)
    model = header.get("model")
    if model is not None:
        if (
            not isinstance(model, list)
            or not all(isinstance(n, str) for n in model)
            or len(set(model)) != len(model)
        ):
            fail("model must be null or a list of distinct names")
        for name in model:
            ref(schema.model_key(name), schema.model_key(name), f"model entry {name!r:.80}")
    if header.get("extra") is not None:
        run_state.check(header["extra"], fail, ref)
    unreferenced = sorted(set(tensors) - set(referenced))
    if unreferenced:
        fail(f"tensors {unreferenced[:3]} are listed but no state, param group or model entry names them")
    if header.get("shards") is not None:
        _shards(header["shards"], tensors, fail)
    if header.get("per_rank") is not None:
        fail(
            "per_rank: a per-rank root of coatstate 0.2, whose rank files this version no longer reads; "
            "convert it to one file with coatstate 0.2 (`coatstate convert ROOT ONE.safetensors`)"
        )
    return header


def _check_params(params: dict, group_of: dict, group_sizes: list, fail) -> None:
    """Each params entry: its group, name, shape and compressed moments' formats."""
    for key, info in params.items():
        if not isinstance(info, dict):
            fail(f"params[{key}] must be an object")
        if info.get("group") != group_of[int(key)] or isinstance(info.get("group"), bool):
            fail(
                f"params[{key}].group is {info.get('group')!r:.40}, but param group "
                f"{group_of[int(key)]} lists it"
            )
        if not isinstance(info.get("name"), (str, type(None))):
            fail(f"params[{key}].name must be a string or null")
        if info.get("shape") is not None and not _shape(info["shape"]):
            fail(f"params[{key}].shape must be a list of non-negative ints or null")
        compressed = info.get("compressed", {})
        if not isinstance(compressed, dict) or not set(compressed) <= set(ALL_MOMENTS):
            fail(f"params[{key}].compressed must map moments {ALL_MOMENTS} to their format")
        for m, f in compressed.items():
            if not isinstance(f, dict) or f.get("format") not in _FORMATS:
                fail(f"params[{key}].compressed.{m}.format must be one of {sorted(_FORMATS)}")
            if f["format"] in _FP4_FORMATS and (m in FIRST_MOMENTS) != (f["format"] == "e2m1"):
                fail(f"params[{key}].compressed.{m}.format {f['format']!r} is not a format for {m}")
            if (
                not _is_int(f.get("group_size"))
                or not 1 <= f["group_size"] <= MAX_GROUP_SIZE
                or not isinstance(f.get("expand"), bool)
            ):
                fail(
                    f"params[{key}].compressed.{m} needs a positive int group_size (at most "
                    f"{MAX_GROUP_SIZE}) and a bool expand"
                )
            if f["format"] in _FP4_FORMATS and (f.get("expand") is not False or f["group_size"] % 2):
                fail(
                    f"params[{key}].compressed.{m}: a 4-bit format needs expand false and an even group_size"
                )
            if f["group_size"] != group_sizes[info["group"]]:
                fail(
                    f"params[{key}].compressed.{m}.group_size is {f['group_size']}, its param group's "
                    f"group_size is {group_sizes[info['group']]}"
                )


def _check_state(state: dict, params: dict, group_sizes: list, ref, fail) -> None:
    """Each state entry: tensors by reference to their own key, plain values otherwise."""
    for key, entry in state.items():
        if key not in params:
            fail(f"state[{key!r:.40}] belongs to no parameter of params")
        if not isinstance(entry, dict):
            fail(f"state[{key}] must be an object")
        values = {}
        for name, v in entry.items():
            if isinstance(v, dict) and "$tensor" in v:
                if schema.tag_problem(v):
                    fail(f"state[{key}].{name}: {schema.tag_problem(v)}")
                values[name] = ref(v["$tensor"], schema.state_key(int(key), name), f"state[{key}].{name}")
            else:
                values[name] = _plain(v, f"state[{key}].{name}", fail)
                if _contains_ref(values[name]):
                    fail(f"state[{key}].{name}: a tensor may only be a state's own value")
        _param_state(key, values, params[key], group_sizes[params[key]["group"]], fail)


def _contains_ref(v: Any) -> bool:
    if isinstance(v, _Ref):
        return True
    if isinstance(v, (list, tuple)):
        return any(_contains_ref(x) for x in v)
    return isinstance(v, dict) and any(_contains_ref(x) for x in v.values())


def _tensors(infos: dict, fail, checksums: bool) -> dict[str, _Tensor]:
    out = {}
    for key, info in infos.items():
        if not isinstance(info, dict):
            fail(f"tensors[{key!r:.80}] must be an object")
        if info.get("dtype") not in schema.DTYPES or not _shape(info.get("shape")):
            fail(f"tensors[{key!r:.80}] needs a dtype of {sorted(schema.DTYPES)} and a shape")
        digest = info.get("checksum")
        if checksums and not (
            isinstance(digest, str) and digest.startswith("sha256:") and _HEX64.fullmatch(digest[7:])
        ):
            fail(f"tensors[{key!r:.80}].checksum must be 'sha256:' and 64 hex digits")
        if info.get("encoding") not in (None, "zstd"):
            fail(f"tensors[{key!r:.80}].encoding must be absent or 'zstd'")
        if info.get("encoding") == "zstd" and not (
            _is_int(info.get("stored_bytes")) and info["stored_bytes"] >= 0
        ):
            fail(f"tensors[{key!r:.80}] is zstd-encoded but has no stored_bytes")
        out[key] = _Tensor(info["dtype"], info["shape"])
    return out


def _check_group_values(g: int, values: dict[str, Any], fail, saved_class: str | None) -> None:
    """Hyperparameters by the rules of the optimizer the file names (formats.optimizer_schema:
    a state dict saved without a class is recognised by its keys); a class it does not know
    (torch's Adafactor: eps=(None, 1e-3); three betas elsewhere) keeps its own, which its
    class checks when it loads them. coatstate's own options are checked wherever they are."""
    where = f"param_groups[{g}]"

    def tensor_ok(name: str, v: Any) -> bool:
        if not isinstance(v, _Tensor):
            return False
        floating = v.dtype.startswith(("float", "bfloat")) and not v.dtype.startswith("float8")
        if math.prod(v.shape) != 1 or not floating:
            fail(f"{where}.{name} must be a one-element floating-point tensor; got {v.dtype} {v.shape}")
        return True

    kind = optimizer_schema.kind_of(saved_class, values)
    optimizer_schema.check_hyperparameters(kind, where, values, fail, tensor_ok)
    for name in _BOOL_KEYS:
        if name in values and not isinstance(values[name], bool):
            fail(f"{where}.{name} must be true or false; got {values[name]!r:.40}")
    size = values.get("group_size", 1)
    if not (_is_int(size) and 1 <= size <= MAX_GROUP_SIZE):
        fail(f"{where}.group_size must be an integer from 1 to {MAX_GROUP_SIZE}; got {size!r:.40}")
    if "min_numel" in values and not (_is_int(values["min_numel"]) and values["min_numel"] >= 0):
        fail(f"{where}.min_numel must be a non-negative integer")
    for name in _FORMAT_KEYS:
        if name in values and values[name] not in _FORMATS:
            fail(f"{where}.{name} must be one of {sorted(_FORMATS)}; got {values[name]!r:.40}")
    if values.get("master_bits") not in (None, 16, 24, 32) or isinstance(values.get("master_bits"), bool):
        fail(f"{where}.master_bits must be null, 16, 24 or 32")
    if "master_seed" in values and not _is_int(values["master_seed"]):
        fail(f"{where}.master_seed must be an integer")


def _param_groups(groups: list, fail, ref, saved_class: str | None) -> dict[int, int]:
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            fail(f"param_groups[{g}] must be an object")
        pids = group.get("params")
        if not isinstance(pids, list) or not all(_is_int(p) and p >= 0 for p in pids):
            fail(f"param_groups[{g}].params must be a list of non-negative param ids")
        for pid in pids:
            if pid in group_of:
                fail(f"param id {pid} is listed by param groups {group_of[pid]} and {g}")
            group_of[pid] = g
        names = group.get("param_names")
        if names is not None and not (
            isinstance(names, list) and len(names) == len(pids) and all(isinstance(n, str) for n in names)
        ):
            fail(f"param_groups[{g}].param_names must list one name per param")
        values = {}
        for k, v in group.items():
            if k in ("params", "param_names"):
                continue
            if isinstance(v, dict) and "$tensor" in v and not schema.tag_problem(v):
                values[k] = ref(v["$tensor"], schema.group_key(g, k), f"param_groups[{g}].{k}")
            else:
                values[k] = _plain(v, f"param_groups[{g}].{k}", fail)
                if _contains_ref(values[k]):
                    fail(f"param_groups[{g}].{k}: a tensor may only be a hyperparameter's own value")
        _check_group_values(g, values, fail, saved_class)
    return group_of


def _check_packed(where: str, m: str, codes: Any, shape: Any, group_size: int, key: str, fail) -> list[int]:
    """4-bit codes: (rows, ceil(cols / 2)) of the parameter's recorded shape, which they need.
    Returns that shape (the moment's, for the scales' and the shape checks)."""
    if shape is None:
        fail(f"{where}: 4-bit {m}{CODES} need their parameter's shape (params[{key}].shape is null)")
    rows, cols, _ = group_layout(tuple(shape), group_size)
    if list(codes.shape) != [rows, (cols + 1) // 2]:
        fail(
            f"{where}.{m}{CODES} is {codes.shape}; a parameter of shape {shape} in 4 bits packs into "
            f"{[rows, (cols + 1) // 2]} bytes"
        )
    return list(shape)


def _param_state(key: str, values: dict[str, Any], info: dict, group_size: int, fail) -> None:
    """One parameter's state: moments shaped like the parameter, compressed parts consistent."""
    where = f"state[{key}]"
    step = values.get("step")
    if isinstance(step, _Tensor):
        if math.prod(step.shape) != 1 or step.dtype in ("float8_e4m3fn", "float8_e5m2", "bool"):
            fail(f"{where}.step must be a one-element number tensor; got {step.dtype} {step.shape}")
    elif step is not None and not (_is_num(step) and step >= 0):
        fail(f"{where}.step must be a non-negative number or tensor; got {step!r:.40}")
    shape = info.get("shape")
    compressed = info.get("compressed") or {}
    for m in ALL_MOMENTS:
        parts = {s: values.get(m + s) for s in ("", CODES, SCALES, EXPONENTS) if m + s in values}
        if not parts:
            if m in compressed:
                fail(f"params[{key}].compressed lists {m}, which its state does not hold")
            continue
        if any(not isinstance(v, _Tensor) for v in parts.values()):
            fail(f"{where}.{m}: moments must be tensors")
        if "" in parts:
            if len(parts) > 1 or m in compressed:
                fail(f"{where}: {m} is both a float tensor and compressed parts")
            dtype, mshape = parts[""].dtype, parts[""].shape
            if not dtype.startswith(("float", "bfloat")) or dtype.startswith("float8"):
                fail(f"{where}.{m} must be a floating-point tensor; got {dtype}")
        else:
            if CODES not in parts or SCALES not in parts or m not in compressed:
                fail(
                    f"{where}: compressed {m} needs {m}{CODES}, {m}{SCALES} and its "
                    f"params[{key}].compressed entry"
                )
            fmt = compressed[m]
            dtype, mshape = parts[CODES].dtype, parts[CODES].shape
            if dtype != _FORMATS[fmt["format"]]:
                fail(f"{where}.{m}{CODES} is {dtype} but its format is {fmt['format']}")
            if (EXPONENTS in parts) != fmt["expand"]:
                fail(f"{where}: {m}{EXPONENTS} must be present exactly when expand is true")
            if fmt["format"] in _FP4_FORMATS:
                mshape = _check_packed(where, m, parts[CODES], shape, group_size, key, fail)
            rows, _, groups = group_layout(mshape, group_size)
            for part, want in ((SCALES, "float32"), (EXPONENTS, "uint8")):
                if part in parts and (parts[part].dtype, parts[part].shape) != (want, [rows, groups]):
                    got = parts[part]
                    fail(
                        f"{where}.{m}{part} is {got.dtype} {got.shape}; codes of shape {mshape} in groups of "
                        f"{group_size} need {want} {[rows, groups]} (group_size disagrees with the scales?)"
                    )
        if shape is None:
            shape = mshape
        elif list(mshape) != list(shape):
            fail(f"{where}.{m} has shape {mshape} but its parameter (params[{key}]) has shape {shape}")


def _shards(shards: Any, tensors: Mapping[str, Any], fail) -> None:
    if not isinstance(shards, list) or not shards:
        fail("shards must be null or a non-empty list")
    owner: dict[str, int] = {}
    for i, s in enumerate(shards):
        if not isinstance(s, dict):
            fail(f"shards[{i}] must be an object")
        name = s.get("file")
        if not (isinstance(name, str) and name.endswith(".safetensors") and name == name.strip()):
            fail(f"shards[{i}].file must be a .safetensors file name")
        if "/" in name or "\\" in name or name.startswith(".") or "\x00" in name:
            fail(f"shards[{i}].file {name!r:.80} must be a plain file name in the checkpoint's directory")
        if not (isinstance(s.get("sha256"), str) and _HEX64.fullmatch(s["sha256"])):
            fail(f"shards[{i}].sha256 must be 64 hex digits")
        if not (_is_int(s.get("bytes")) and s["bytes"] >= 0):
            fail(f"shards[{i}].bytes must be a non-negative integer")
        keys = s.get("tensors")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            fail(f"shards[{i}].tensors must be a list of tensor keys")
        for k in keys:
            if k not in tensors or k in owner:
                where = f"in shard {owner[k]} already" if k in owner else "not in the header"
                fail(f"shards[{i}] lists tensor {k!r:.80}, which is {where}")
            owner[k] = i
    if set(owner) != set(tensors):
        fail(f"tensors {sorted(set(tensors) - set(owner))[:3]} are in no shard")


# ---------------------------------------------------------------------- plain state dicts
def check_state_dict(sd: Any, where: str) -> dict[str, Any]:
    """An optimizer state dict from a .pt or a DCP directory: the structure load() relies on."""
    if not (
        isinstance(sd, dict)
        and isinstance(sd.get("state"), dict)
        and isinstance(sd.get("param_groups"), list)
    ):
        raise CheckpointError(
            f"{where}: not an optimizer state dict (expected a dict with 'state' and 'param_groups')"
        )
    if schema.json_depth(sd) > schema.MAX_JSON_DEPTH:
        raise CheckpointError(f"{where}: the state dict is nested deeper than {schema.MAX_JSON_DEPTH} levels")
    seen: set = set()
    for g, group in enumerate(sd["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise CheckpointError(f"{where}: param_groups[{g}] must be a dict with a 'params' list")
        for pid in group["params"]:
            if not isinstance(pid, (int, str)) or isinstance(pid, bool) or pid in seen:
                raise CheckpointError(
                    f"{where}: param_groups[{g}] lists param id {pid!r:.40} twice or of a bad type"
                )
            seen.add(pid)
    for pid, state in sd["state"].items():
        if pid not in seen or not isinstance(state, dict):
            raise CheckpointError(f"{where}: state of param id {pid!r:.40} is not a dict of a listed param")
    return sd


# --------------------------------------------------------------- against the loading side
def check_class(optimizer, saved_class: str | None, has_codes: bool, compressed: bool, where: str) -> None:
    """Refuse a checkpoint of another optimizer class (its states would load as wrong ones).
    `compressed`: whether `optimizer` is one of coatstate's (the caller knows the class)."""
    ours = type(optimizer).__name__
    lineage = {c.__name__ for c in type(optimizer).__mro__}
    if saved_class is None:  # saved from a state dict: compressed moments are coatstate's
        if has_codes and not (compressed or optimizer_schema.kind_of(ours) is not None):
            raise CheckpointError(
                f"{where}: holds compressed moments; {ours} cannot use them (load it into one of "
                "coatstate's optimizers or its torch reference)"
            )
        return
    if saved_class in lineage or any(optimizer_schema.same_family(saved_class, c) for c in lineage):
        return
    kind = optimizer_schema.kind_of(saved_class)
    into = f"{kind.compressed} or {kind.reference}" if kind is not None else saved_class
    raise CheckpointError(
        f"{where}: holds the state of a {saved_class}, which a {ours} cannot load (the header names the "
        f"class that saved it); load it into a {into}"
    )


def _expected_shape(pid: Any, header: Mapping[str, Any], state: Mapping[Any, Any]) -> list[int] | None:
    info = (header.get("params") or {}).get(str(pid)) or {}
    if info.get("shape") is not None:
        return list(info["shape"])
    for name in ("exp_avg" + CODES, *ALL_MOMENTS):
        t = state.get(pid, {}).get(name)
        if isinstance(t, torch.Tensor) and t.dtype != torch.uint8:  # packed 4-bit codes: not the shape
            return list(t.shape)
    return None


def check_optimizer(optimizer, ckpt, names: Mapping[int, str], where: str) -> None:
    """Group and param counts equal, and every parameter's recorded shape equal to the optimizer's."""
    file_groups = ckpt.optimizer["param_groups"]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in file_groups]
    if ours != theirs:
        raise CheckpointError(
            f"{where}: the file has {len(theirs)} param group(s) with {theirs} params; the optimizer has "
            f"{len(ours)} with {ours}"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [pid for g in file_groups for pid in g["params"]]
    for index, (pid, p) in enumerate(zip(ids, params, strict=True)):
        shape = _expected_shape(pid, ckpt.header, ckpt.optimizer["state"])
        if shape is not None and list(p.shape) != shape:
            info = (ckpt.header.get("params") or {}).get(str(pid)) or {}
            name = info.get("name") or names.get(index) or f"#{index}"
            raise CheckpointError(
                f"{where}: parameter {name} (index {index}) has shape {list(p.shape)} in the optimizer "
                f"but {shape} in the checkpoint"
            )


def check_model(model: torch.nn.Module, saved: Mapping[str, torch.Tensor] | None, where: str) -> None:
    """Same keys and shapes, and each saved tensor's dtype copyable into the model's (tried on a
    scalar of that dtype: a saved DTensor holding only this rank's rows is checked the same way)."""
    if saved is None:
        raise CheckpointError(f"{where}: holds no model state dict (save it with save(..., model=model))")
    current = model.state_dict()
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: model keys differ: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, t in current.items():
        s = saved[name]
        if not isinstance(s, torch.Tensor) or t.shape != s.shape:
            got = list(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise CheckpointError(
                f"{where}: model tensor {name} has shape {list(t.shape)} in the model but {got} in the "
                "checkpoint"
            )
        if s.numel():
            try:  # a copy the model's load_state_dict would refuse fails here, before anything is loaded
                torch.empty((), dtype=t.dtype).copy_(torch.zeros((), dtype=s.dtype))
            except (RuntimeError, TypeError) as e:
                raise CheckpointError(
                    f"{where}: model tensor {name} is {s.dtype} in the checkpoint and cannot be copied into "
                    f"the model's {t.dtype} ({e})"
                ) from None
