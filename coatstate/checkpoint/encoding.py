"""A state dict as a checkpoint's tensors and JSON header, and back.

`flatten` turns an optimizer state dict (and a model's) into the tensors a checkpoint stores under
their keys and the header that describes them (formats.schema, docs/CHECKPOINT.md); `decode`
checks stored tensors against a header and undoes the zstd encoding. No file is touched here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from coatstate import __version__
from coatstate.checkpoint import container, validate
from coatstate.checkpoint import extra as run_state
from coatstate.formats import schema
from coatstate.formats.optimizer_state import (
    ALL_MOMENTS,
    CODES,
    EXPONENTS,
    FP4_NAMES,
    format_option,
    moment_of,
)
from coatstate.formats.schema import CheckpointError

MAX_ZSTD_RATIO = 2**17
"""zstd's format cannot expand a frame by more than about 32768 times (a 128 KiB block from a few
bytes, plus frame overhead): a claim beyond this bound is refused before anything is allocated."""


def dense_problem(t: torch.Tensor) -> str | None:
    """Why `t` has no bytes a checkpoint can store (a sparse or meta tensor), or None."""
    if t.layout != torch.strided:
        layout = str(t.layout).removeprefix("torch.")
        return f"a {layout} tensor (a checkpoint stores dense ones: .to_dense() it)"
    if t.is_meta:
        return "a meta tensor, which has no data (materialize it, e.g. with to_empty(), and fill it)"
    return None


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def numbered(sd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, str]]:
    """(`sd` with its parameters numbered 0.. in param-group order, {number: name}) for a state
    dict keyed by parameter name, as torch.distributed.checkpoint.state_dict's
    get_optimizer_state_dict returns it (`{"state": {"0.weight": ...}, "param_groups":
    [{"params": ["0.weight", ...]}]}`); a state dict keyed by number is returned as it is."""
    ids = [pid for g in sd["param_groups"] for pid in g["params"]]
    if not any(isinstance(pid, str) for pid in ids):
        return dict(sd), {}
    index = {pid: i for i, pid in enumerate(ids)}
    unknown = [k for k in sd["state"] if k not in index]
    if len(index) != len(ids) or unknown:
        raise ValueError(
            f"a state dict keyed by parameter name must list each name in exactly one param group; "
            f"state for {unknown[:3]} is listed in none" if unknown else "a name is listed twice"
        )
    state = {index[k]: v for k, v in sd["state"].items()}
    groups = [dict(g, params=[index[p] for p in g["params"]]) for g in sd["param_groups"]]
    names = {i: str(pid) for pid, i in index.items()}
    return {**sd, "state": state, "param_groups": groups}, names


def source(
    obj: Any, model: Any, param_names: Any
) -> tuple[dict, dict[int, list[int]], dict[int, str], str | None]:
    """(state dict, {pid: shape}, {pid: name}, optimizer class name) from what save() was given."""
    shapes: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    if isinstance(obj, torch.optim.Optimizer):
        sd = obj.state_dict()
        by_obj = {}
        if isinstance(model, torch.nn.Module):
            by_obj = {id(p): n for n, p in model.named_parameters()}
        pid = 0
        for group in obj.param_groups:
            for p in group["params"]:
                shapes[pid] = list(p.shape)
                if id(p) in by_obj:
                    names[pid] = by_obj[id(p)]
                pid += 1
        # a class that writes another's format (HostOffloadAdamW: CompressedAdamW's) names that one
        kind = getattr(type(obj), "checkpoint_class", type(obj).__name__)
    elif isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj:
        (sd, names), kind = numbered(obj), None  # (keyed by name: the names are kept)
    else:
        raise TypeError(
            "save() takes a torch.optim.Optimizer or an optimizer state dict (a mapping with 'state' "
            f"and 'param_groups'); got {type(obj).__name__}"
        )
    for group in sd["param_groups"]:  # torch >= 2.6 optimizers built from named_parameters()
        for pid, name in zip(group["params"], group.get("param_names", ()), strict=False):
            names.setdefault(pid, name)
    if param_names is not None:
        items = param_names.items() if isinstance(param_names, Mapping) else enumerate(param_names)
        names.update({int(k): str(v) for k, v in items})
    if isinstance(model, torch.nn.Module):
        by_name = {n: list(p.shape) for n, p in model.named_parameters()}
    elif isinstance(model, Mapping):
        by_name = {n: list(t.shape) for n, t in model.items() if isinstance(t, torch.Tensor)}
    else:
        by_name = {}
    for pid, name in names.items():  # a parameter without state has no other record of its shape
        if pid not in shapes and name in by_name:
            shapes[pid] = by_name[name]
    return sd, shapes, names, kind


def _code_format(moment: str, codes: torch.Tensor, group: Mapping[str, Any]) -> str:
    """A moment's format name: FP8 codes say it by their dtype; 4-bit codes (uint8) are in their
    param group's format for that moment."""
    if codes.dtype == torch.uint8:
        return str(group.get(format_option(moment)))
    return "e4m3" if codes.dtype == torch.float8_e4m3fn else "e5m2"


def _moment_formats(state: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in state.items():
        parts = moment_of(name)
        if parts and parts[1] == CODES and isinstance(value, torch.Tensor):
            moment = parts[0]
            out[moment] = {
                "format": _code_format(moment, value, group),
                "group_size": group.get("group_size"),
                "expand": moment + EXPONENTS in state,
            }
    return out


def flatten(
    sd: Mapping[str, Any], shapes, names, model_sd, *, prepare=to_cpu, checksums: bool = True, extra=None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by key, header). `prepare` maps each tensor (a per-rank save keeps DTensors as
    they are); checksums=False leaves them out of the header (a per-rank save adds its own);
    `extra`: the run's other state (checkpoint/extra.py), in the header's `extra`."""
    def prepare_checked(t: torch.Tensor, where: str) -> torch.Tensor:
        problem = dense_problem(t)
        if problem:
            raise TypeError(f"{where} is {problem}")
        return prepare(t)

    tensors: dict[str, torch.Tensor] = {}
    groups, params = [], {}
    for g, group in enumerate(sd["param_groups"]):
        enc = {}
        for k, v in group.items():
            if isinstance(v, torch.Tensor):
                tensors[schema.group_key(g, k)] = prepare_checked(v, f"param_groups[{g}].{k}")
                enc[k] = {"$tensor": schema.group_key(g, k)}
            else:
                enc[k] = schema.encode_value(v, f"param_groups[{g}].{k}")
        groups.append(enc)
        for pid in group["params"]:
            params[str(pid)] = {"group": g, "name": names.get(pid), "shape": shapes.get(pid)}
    state = {}
    for pid, pstate in sd["state"].items():
        if str(pid) not in params:
            raise ValueError(f"state dict has state for param id {pid}, which no param group lists")
        entry = {}
        for name, v in pstate.items():
            if isinstance(v, torch.Tensor):
                key = schema.state_key(pid, name)
                tensors[key] = prepare_checked(v, f"state[{pid}].{name}")
                entry[name] = {"$tensor": key}
            else:
                entry[name] = schema.encode_value(v, f"state[{pid}].{name}")
        state[str(pid)] = entry
        info = params[str(pid)]
        info["compressed"] = _moment_formats(pstate, sd["param_groups"][info["group"]])
        if info["shape"] is None:
            for name in (*(m + CODES for m in ALL_MOMENTS), *ALL_MOMENTS):
                t = pstate.get(name)
                if isinstance(t, torch.Tensor) and t.dtype != torch.uint8:  # packed 4-bit: not the shape
                    info["shape"] = list(t.shape)
                    break
        if info["shape"] is None and any(f["format"] in FP4_NAMES for f in info["compressed"].values()):
            raise ValueError(
                f"param {pid} has 4-bit moments, whose packed codes do not record the parameter's "
                "shape: save the optimizer itself, or pass model= so its shape is known"
            )
    model_keys = None
    if model_sd is not None:
        model_keys = []
        for name, v in model_sd.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"model state dict entry {name!r} is a {type(v).__name__}, not a tensor")
            tensors[schema.model_key(name)] = prepare_checked(v, f"model entry {name!r}")
            model_keys.append(name)
    extra_header = run_state.flatten(extra, tensors, prepare_checked) if extra is not None else None
    compressed = any(p.get("compressed") for p in params.values())
    header = {
        "format": schema.FORMAT_NAME,
        "format_version": schema.FORMAT_VERSION,
        "library_version": __version__,
        "created_unix": round(time.time(), 3),
        "optimizer": {"class": None, "variant": "compressed" if compressed else "full"},
        "param_groups": groups,
        "params": params,
        "state": state,
        "model": model_keys,
        "checksum": schema.CHECKSUM_ALGORITHM,
        "compression": None,
        "shards": None,
        "tensors": {
            k: {"dtype": schema.dtype_name(t.dtype), "shape": list(t.shape)} for k, t in tensors.items()
        },
    }
    if extra_header is not None:  # (absent otherwise: headers without it are as they were)
        header["extra"] = extra_header
    if checksums:
        for key, digest in schema.tensor_checksums(tensors).items():
            header["tensors"][key]["checksum"] = digest
    return tensors, header


def check_writable(header: dict[str, Any], where: str) -> None:
    """Refuse, before anything is written, a header that `validate_header` would refuse on read:
    the writer checks exactly what the reader enforces, so no save succeeds into a file that no
    reader opens. Checksums not computed yet (a per-rank save adds its own) stand in as zeros."""
    unsummed = {k: {"checksum": "sha256:" + "0" * 64, **v} for k, v in header["tensors"].items()}
    probe = dict(header, tensors=unsummed)
    try:
        if schema.json_depth(probe) > schema.MAX_JSON_DEPTH:  # (what loads_json refuses on read)
            raise CheckpointError(f"{where}: a value is nested deeper than {schema.MAX_JSON_DEPTH} levels")
        validate.validate_header(probe, where)
    except CheckpointError as e:
        problem = str(e).removeprefix(f"{where}: invalid header: ").removeprefix(f"{where}: ")
        raise CheckpointError(
            f"{where}: not saved: a reader would refuse this state ({problem}). Save the optimizer "
            "itself rather than its state dict (the header then names its class, whose own values "
            "are kept as they are), or fix the value named"
        ) from None


def encode_zstd(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> dict[str, torch.Tensor]:
    stored = {}
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes >= container.ZSTD_MIN_BYTES:
            blob = container.zstd_compress(schema.tensor_bytes(t))
            if len(blob) < nbytes:
                stored[key] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                header["tensors"][key].update(encoding="zstd", stored_bytes=len(blob))
                continue
        stored[key] = t
    header["compression"] = "zstd"
    return stored


def metadata(header: Mapping[str, Any]) -> dict[str, str]:
    text = schema.dump_header(header)
    return {
        "format": "pt",
        schema.METADATA_KEY: text,
        schema.HEADER_CHECKSUM_KEY: schema.header_checksum(text),
    }


def decode(stored: Mapping[str, torch.Tensor], header: Mapping[str, Any], where: str, verify: bool):
    infos = header["tensors"]
    extra = sorted(set(stored) - set(infos))
    if extra:
        raise CheckpointError(f"{where}: tensors {extra[:5]} are in the file but not in its header")
    out = {}
    for key, info in infos.items():
        if key not in stored:
            raise CheckpointError(
                f"{where}: tensor {key!r} is listed in the header but missing from the file"
            )
        t = stored[key]
        try:
            dtype, shape = schema.torch_dtype(info["dtype"]), [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: corrupt header entry for {key!r} ({e!r})") from None
        if info.get("encoding") == "zstd":
            # Python ints: a shape whose element count overflows int64 is a wrong size, not a crash
            nbytes = dtype.itemsize * math.prod(shape)
            if nbytes > len(t) * MAX_ZSTD_RATIO:
                raise CheckpointError(
                    f"{where}: tensor {key!r} claims {nbytes} bytes from {len(t)} compressed bytes, more "
                    f"than a zstd frame can expand to (over {MAX_ZSTD_RATIO}:1): the file is corrupt"
                )
            blob = schema.tensor_bytes(t)
            t = torch.empty(shape, dtype=dtype)
            container.zstd_decompress_into(blob, schema.tensor_bytes(t), f"{where}: {key}")
        if t.dtype != dtype or list(t.shape) != shape:
            raise CheckpointError(
                f"{where}: tensor {key!r} is {t.dtype} {list(t.shape)} in the file but "
                f"{info['dtype']} {shape} in the header"
            )
        out[key] = t
    if verify:
        for key, digest in schema.tensor_checksums(out).items():
            if digest != infos[key].get("checksum"):
                raise CheckpointError(f"{where}: checksum mismatch for tensor {key!r}: the file is corrupt")
    return out
