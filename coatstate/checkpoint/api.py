"""Save, load and read optimizer checkpoints (with the model's state dict if wanted).

One safetensors file per checkpoint (or a root file plus shards), through any fsspec URL;
docs/CHECKPOINT.md specifies the layout. CompressedAdamW states are stored as their plain
tensors (codes, scales, exponents); any torch optimizer whose state is tensors and plain values
(torch.optim.AdamW included) is stored the same way, uncompressed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from coatstate import __version__
from coatstate import distributed as dtensors
from coatstate.checkpoint import (
    background,
    container,
    rank_cleanup,
    rank_commit,
    rank_read,
    shards,
    storage,
    validate,
)
from coatstate.checkpoint.dcp import load_failure, read_dcp, weights_only_load
from coatstate.formats import schema
from coatstate.formats.optimizer_state import (
    CODES,
    EXPONENTS,
    MASTER_CORRECTION,
    MOMENTS,
    is_compressed,
    moment_of,
)
from coatstate.formats.schema import CheckpointError
from coatstate.optim import CompressedAdamW, join_master, to_adamw_state_dict

__all__ = ["Checkpoint", "CheckpointError", "load", "read", "read_header", "read_state_dict", "save"]

DEFAULT_SHARD_SIZE = 5 * 2**30
"""Bytes above which a checkpoint is split into shards (as Hugging Face does for weights)."""
PT_EXTENSIONS = (".pt", ".pth", ".bin")
"""Read as torch.save files whatever their first bytes (others by their magic)."""
READ_ATTEMPTS = 8
"""Roots re-read when a newer save removed a shard mid-read."""


@dataclasses.dataclass
class Checkpoint:
    """What a checkpoint file holds."""

    optimizer: dict[str, Any]
    """The optimizer state dict ({"state": ..., "param_groups": ...}), tensors on the CPU."""
    model: dict[str, torch.Tensor] | None
    """The model state dict saved with it, or None."""
    header: dict[str, Any]
    """The JSON header (formats.schema); {} for a .pt input."""


# ------------------------------------------------------------------------------------ saving
def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _source(
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
        kind = type(obj).__name__
    elif isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj:
        sd, kind = dict(obj), None
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


def _moment_formats(state: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in state.items():
        parts = moment_of(name)
        if parts and parts[1] == CODES and isinstance(value, torch.Tensor):
            moment = parts[0]
            out[moment] = {
                "format": "e4m3" if value.dtype == torch.float8_e4m3fn else "e5m2",
                "group_size": group.get("group_size"),
                "expand": moment + EXPONENTS in state,
            }
    return out


def _flatten(
    sd: Mapping[str, Any], shapes, names, model_sd, *, prepare=_cpu, checksums: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by key, header). `prepare` maps each tensor (a per-rank save keeps DTensors as
    they are); checksums=False leaves them out of the header (a per-rank save adds its own)."""
    tensors: dict[str, torch.Tensor] = {}
    groups, params = [], {}
    for g, group in enumerate(sd["param_groups"]):
        enc = {}
        for k, v in group.items():
            if isinstance(v, torch.Tensor):
                tensors[schema.group_key(g, k)] = prepare(v)
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
                tensors[key] = prepare(v)
                entry[name] = {"$tensor": key}
            else:
                entry[name] = schema.encode_value(v, f"state[{pid}].{name}")
        state[str(pid)] = entry
        info = params[str(pid)]
        info["compressed"] = _moment_formats(pstate, sd["param_groups"][info["group"]])
        if info["shape"] is None:
            for name in ("exp_avg" + CODES, "exp_avg"):
                if isinstance(pstate.get(name), torch.Tensor):
                    info["shape"] = list(pstate[name].shape)
                    break
    model_keys = None
    if model_sd is not None:
        model_keys = []
        for name, v in model_sd.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"model state dict entry {name!r} is a {type(v).__name__}, not a tensor")
            tensors[schema.model_key(name)] = prepare(v)
            model_keys.append(name)
    compressed = any(p.get("compressed") for p in params.values())
    header = {
        "format": schema.FORMAT_NAME,
        "format_version": schema.SINGLE_FILE_FORMAT_VERSION,
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
    if checksums:
        for key, digest in schema.tensor_checksums(tensors).items():
            header["tensors"][key]["checksum"] = digest
    return tensors, header


def _encode_zstd(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> dict[str, torch.Tensor]:
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


def _metadata(header: Mapping[str, Any]) -> dict[str, str]:
    text = schema.dump_header(header)
    return {
        "format": "pt",
        schema.METADATA_KEY: text,
        schema.HEADER_CHECKSUM_KEY: schema.header_checksum(text),
    }


def save(
    optimizer_or_state_dict: torch.optim.Optimizer | Mapping[str, Any],
    url: str | os.PathLike,
    *,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
    compress: str | None = None,
    shard_size: int | None = DEFAULT_SHARD_SIZE,
    param_names: Mapping[int, str] | list[str] | None = None,
    blocking: bool = True,
    distributed: str = "gathered",
) -> background.SaveHandle | None:
    """Write an optimizer (CompressedAdamW or any torch optimizer) to `url`, atomically.

    blocking=False: snapshot the state (CUDA tensors into pinned host memory) and return a
    `SaveHandle` at once; a background thread writes and commits the file. The next save,
    `handle.wait()` or the interpreter's exit waits for it and raises a failure there.

    model: an nn.Module or a model state dict stored in the same file, so one file resumes a run;
    with an nn.Module the parameter names are also recorded. compress: None or "zstd" (per
    tensor, frame checksums on; measured ~1.1x on FP8 states, so off by default). Above
    `shard_size` bytes the tensors go to shard files next to `url` and `url` holds the index.

    distributed (docs/CHECKPOINT.md, "Distributed"): "gathered" (default) all-gathers DTensor
    (FSDP2) states and rank 0 writes one file (every rank calls save(); DDP: rank 0 only).
    "per_rank": every rank calls save() and writes its own rows to its own file, rank 0 then the
    root `url` (the commit point); blocking=False works; loads at any world size; no zstd.
    """
    if compress not in (None, "zstd"):
        raise ValueError(f"compress must be None or 'zstd'; got {compress!r}")
    if distributed not in ("gathered", "per_rank"):
        raise ValueError(f"distributed must be 'gathered' or 'per_rank'; got {distributed!r}")
    if distributed == "per_rank" and compress is not None:
        raise ValueError(
            "compress='zstd' is not available with distributed='per_rank' (rows are read by range): save "
            "per-rank without compress, then `coatstate convert ROOT ONE.safetensors --zstd` makes one "
            "zstd file; or save with distributed='gathered'"
        )
    if shard_size is not None and (not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"shard_size must be a positive int (bytes) or None; got {shard_size!r}")
    if distributed == "per_rank" and shard_size not in (None, DEFAULT_SHARD_SIZE):  # was ignored silently
        raise ValueError(
            f"shard_size={shard_size} does not apply to distributed='per_rank': a per-rank save writes one "
            "file per rank; drop shard_size, or save a single file (distributed='gathered') to shard it"
        )
    url = os.fspath(url)
    # every save waits for the one in flight (whose failure is raised here, before anything else):
    # two saves of one process never race for a file, nor for the per-rank pinned buffers
    background.wait_for_saves()
    sd, shapes, names, kind = _source(optimizer_or_state_dict, model, param_names)
    model_sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if distributed == "per_rank":
        tensors, header = _flatten(sd, shapes, names, model_sd, prepare=torch.Tensor.detach, checksums=False)
        header["optimizer"]["class"] = kind
        return rank_commit.save(url, tensors, header, _metadata, blocking)
    params = getattr(optimizer_or_state_dict, "param_groups", [])
    sharded = (
        dtensors.has_dtensors(sd)
        or any(dtensors.is_dtensor(v) for v in (model_sd or {}).values())
        or any(dtensors.is_dtensor(p) for g in params if isinstance(g, dict) for p in g.get("params", ()))
    )
    if not blocking:
        if sharded:
            raise NotImplementedError(
                "coatstate.save(blocking=False) does not gather sharded (DTensor/FSDP2) states: save "
                "them with distributed='per_rank' (every rank writes its rows in the background)"
            )
        (sd, model_sd), ready = background.snapshot((sd, model_sd))
        return background.start(
            url, lambda: _write(url, sd, shapes, names, kind, model_sd, compress, shard_size), ready
        )
    if not sharded:
        _write(url, sd, shapes, names, kind, model_sd, compress, shard_size)
        return None
    # FSDP2/DTensor: gather every tensor (a collective), rank 0 writes, every rank learns how it went
    sd = dtensors.gather_state_dict(sd)
    if model_sd:
        model_sd = {k: dtensors.full_tensor(v).detach().cpu() for k, v in model_sd.items()}
    error = None
    if dtensors.is_main_process():
        try:
            _write(url, sd, shapes, names, kind, model_sd, compress, shard_size)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks are told
            error = e
    failed = dtensors.broadcast_from_main(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"{url}: rank 0 could not write the checkpoint ({failed})")
    return None


def _write(url, sd, shapes, names, kind, model_sd, compress, shard_size) -> None:
    storage.check_directory(url)
    tensors, header = _flatten(sd, shapes, names, model_sd)
    header["optimizer"]["class"] = kind
    stored = _encode_zstd(tensors, header) if compress == "zstd" else tensors
    previous = shards.write(url, stored, header, shard_size, _metadata)
    if previous is not None and rank_read.is_per_rank(previous):  # its rank files are orphans now
        rank_cleanup.after_commit(url, None, previous)


# ----------------------------------------------------------------------------------- reading
def read_header(url: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a checkpoint, reading only the first bytes of the file."""
    url = os.fspath(url)
    _, _, st_header = container.read_head(url, url)
    return container.coatstate_header(st_header, url)


def _decode(stored: Mapping[str, torch.Tensor], header: Mapping[str, Any], where: str, verify: bool):
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
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            raw = container.zstd_decompress(schema.tensor_bytes(t), nbytes, f"{where}: {key}")
            t = torch.frombuffer(bytearray(raw), dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
            t = t.reshape(shape)
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


def _read_pt(data: bytes, where: str) -> Checkpoint:
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
    return Checkpoint(optimizer=validate.check_state_dict(obj, where), model=None, header={})


def _read_dcp(path: str) -> Checkpoint:
    optimizer, model, names = read_dcp(path)
    validate.check_state_dict(optimizer, path)
    model_shapes = {n: list(t.shape) for n, t in (model or {}).items() if isinstance(t, torch.Tensor)}
    params = {
        str(pid): {"group": g, "name": names.get(pid), "shape": model_shapes.get(names.get(pid))}
        for g, group in enumerate(optimizer["param_groups"])
        for pid in group["params"]
    }
    return Checkpoint(
        optimizer=optimizer, model=model, header={"format": "torch.distributed.checkpoint", "params": params}
    )


def _read_safetensors(url: str, data: bytes, verify: bool) -> Checkpoint:
    _, st_header = container.parse_header(data, url)
    header = container.coatstate_header(st_header, url)
    if rank_read.is_per_rank(header):  # checked block by block as it is read
        return _assemble(url, header, rank_read.read_all(url, header, verify), False)
    stored = shards.read(url, header, verify) if header.get("shards") else container.load_tensors(data, url)
    return _assemble(url, header, stored, verify)


def _assemble(
    url: str, header: dict[str, Any], stored: Mapping[str, torch.Tensor], verify: bool
) -> Checkpoint:
    """The Checkpoint of a header and its stored tensors (whole, or DTensors of this rank's rows)."""
    try:
        tensors = _decode(stored, header, url, verify)
        groups = [schema.decode_value(g, tensors) for g in header["param_groups"]]
        state = {int(pid): schema.decode_value(s, tensors) for pid, s in header["state"].items()}
        model = None
        if header.get("model") is not None:
            model = {name: tensors[schema.model_key(name)] for name in header["model"]}
    except CheckpointError as e:
        if str(e).startswith(url):
            raise
        raise CheckpointError(f"{url}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{url}: malformed header ({e!r})") from None
    return Checkpoint(optimizer={"state": state, "param_groups": groups}, model=model, header=header)


def read(url: str | os.PathLike, *, verify: bool = True) -> Checkpoint:
    """Everything in a checkpoint, checksums verified (no optimizer needed).

    Also reads a torch.save'd optimizer state dict (.pt/.pth/.bin, or any file that starts as a
    zip) with torch.load(weights_only=True) and a local torch.distributed.checkpoint directory
    (coatstate.checkpoint.dcp: whole tensors, any world size; its `header` then lists only the
    parameter names and shapes). Any problem with the input is a CheckpointError naming it.
    """
    url = os.fspath(url)
    try:
        if os.path.isdir(url):
            return _read_dcp(url)
        for _ in range(READ_ATTEMPTS):
            data = storage.read_bytes(url)
            if data[:4] == b"PK\x03\x04" or os.path.splitext(url)[1].lower() in PT_EXTENSIONS:
                return _read_pt(data, url)
            try:
                return _read_safetensors(url, data, verify)
            except shards.ShardMissing:
                if storage.read_bytes(url) == data:
                    raise  # the root did not change: the shard is really gone
        raise CheckpointError(
            f"{url}: the checkpoint was replaced {READ_ATTEMPTS} times while being read; retry"
        )
    except RecursionError:
        raise CheckpointError(f"{url}: nested too deeply to read (a corrupt or hostile file)") from None


def read_state_dict(url: str | os.PathLike) -> dict[str, Any]:
    """The optimizer state dict stored at `url` (checksums verified)."""
    return read(url).optimizer


# ----------------------------------------------------------------------------------- loading
def _read_for(optimizer: torch.optim.Optimizer, url: str, model) -> Checkpoint:
    """What load() needs from `url`. A per-rank checkpoint loaded into DTensor parameters: only
    this rank's rows of their states (and of DTensor model entries), as DTensors; else read()."""
    if (
        not any(dtensors.is_dtensor(p) for g in optimizer.param_groups for p in g["params"])
        or os.path.isdir(url)
        or os.path.splitext(url)[1].lower() in PT_EXTENSIONS
    ):
        return read(url)
    for _ in range(READ_ATTEMPTS):
        try:
            header = read_header(url)
        except CheckpointError:
            return read(url)  # (a zip without a .pt extension; or raised again, by read)
        compressed = any(info.get("compressed") for info in header["params"].values())
        if not rank_read.is_per_rank(header) or (compressed and not isinstance(optimizer, CompressedAdamW)):
            return read(url)  # a plain optimizer decompresses whole tensors
        try:
            return _assemble(url, header, rank_read.read_local(url, header, optimizer, model), False)
        except shards.ShardMissing:
            if read_header(url) == header:
                raise
    raise CheckpointError(f"{url}: the checkpoint was replaced {READ_ATTEMPTS} times while being read; retry")


def _snapshot(optimizer) -> tuple:
    """What load_state_dict may replace or edit: the state and param-group containers, their
    entries and the entries' items (tensors are not copied: loading replaces them, never edits)."""
    entries = [(k, v, dict(v) if isinstance(v, dict) else None) for k, v in optimizer.state.items()]
    return optimizer.state, entries, optimizer.param_groups, [(g, dict(g)) for g in optimizer.param_groups]


def _restore(optimizer, snapshot: tuple) -> None:
    state, entries, groups, group_items = snapshot
    for _, v, items in entries:
        if items is not None:
            v.clear()
            v.update(items)
    state.clear()
    state.update({k: v for k, v, _ in entries})
    for g, items in group_items:
        g.clear()
        g.update(items)
    groups[:] = [g for g, _ in group_items]
    optimizer.state, optimizer.param_groups = state, groups
    for cache in ("_prepared", "_fused_cache", "_released_launches"):  # CompressedAdamW's launch caches
        if isinstance(getattr(optimizer, cache, None), dict):
            getattr(optimizer, cache).clear()


def _join_masters(optimizer, model, ckpt: Checkpoint, names: dict[int, str], url: str) -> Checkpoint:
    """`ckpt` with each 16-bit weight that has a master correction joined into its float32
    master (join_master) where it loads into a float32 parameter: loading the weight alone would
    drop the correction, and with it the master the run stepped on."""
    state = ckpt.optimizer["state"]
    with_master = [pid for pid, s in state.items() if MASTER_CORRECTION in s]
    if not with_master:
        return ckpt
    ids = [pid for g in ckpt.optimizer["param_groups"] for pid in g["params"]]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    into = {pid: p.dtype for pid, p in zip(ids, flat, strict=False)}  # (counts are checked later)
    wide = sorted(pid for pid in with_master if into.get(pid) == torch.float32)
    if not wide:
        return ckpt  # 16-bit parameters: the weights and corrections load as they are
    if model is None or ckpt.model is None or len(wide) != len(with_master):
        why = (
            "pass model= so that load joins each weight with its correction into the float32 parameter"
            if len(wide) == len(with_master)
            else "the optimizer mixes float32 and 16-bit parameters that have corrections"
        )
        raise CheckpointError(
            f"{url}: holds 16-bit weights with master corrections (master_bits) for parameters that "
            f"are float32 in this optimizer ({len(wide)} of them); {why}, or turn the file into a float32 "
            "one first: `coatstate convert SRC DST --master-bits none`"
        )
    by_pid = {pid: names[i] for i, pid in enumerate(ids) if i in names}
    for pid in ids:  # names the header recorded stand in for parameters the model does not name
        recorded = (ckpt.header.get("params") or {}).get(str(pid), {}).get("name")
        if recorded is not None:
            by_pid.setdefault(pid, recorded)
    try:
        model_sd, optimizer_sd = join_master(ckpt.model, ckpt.optimizer, param_names=by_pid)
    except ValueError as e:
        raise CheckpointError(f"{url}: cannot join the master weights for a float32 model ({e})") from None
    return dataclasses.replace(ckpt, optimizer=optimizer_sd, model=model_sd)


def load(
    optimizer: torch.optim.Optimizer,
    url: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
) -> Checkpoint:
    """Restore `optimizer` (and `model`) from `url`; bit-exact for the optimizer that saved it.

    Everything is checked (checksums, the header's schema, the optimizer class the header names,
    param counts, shapes, model keys) before anything is modified, and a load that fails anyway
    (the optimizer refuses the state) leaves optimizer and model as they were. A compressed
    checkpoint loaded into a plain torch optimizer is decompressed first (the values
    CompressedAdamW used, in fp32). With DTensor (FSDP2) parameters every rank keeps its own rows,
    whatever world size saved the file: of a per-rank checkpoint it reads only those rows, of a
    single file the whole file. `url` may also be a local torch.distributed.checkpoint directory.
    """
    url = os.fspath(url)
    ckpt = _read_for(optimizer, url, model)
    local_model = ckpt.model is not None and any(dtensors.is_dtensor(t) for t in ckpt.model.values())
    names = {}
    if model is not None:
        by_obj = {id(p): n for n, p in model.named_parameters()}
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        names = {i: by_obj[id(p)] for i, p in enumerate(flat) if id(p) in by_obj}
    ckpt = _join_masters(optimizer, model, ckpt, names, url)
    sd = ckpt.optimizer
    has_codes = any(is_compressed(s, name) for s in sd["state"].values() for name in MOMENTS)
    compressed_optimizer = isinstance(optimizer, CompressedAdamW)
    saved_class = (ckpt.header.get("optimizer") or {}).get("class")
    validate.check_class(optimizer, saved_class, has_codes, compressed_optimizer, url)
    validate.check_optimizer(optimizer, ckpt, names, url)
    if model is not None:
        validate.check_model(model, ckpt.model, url)
    try:
        if has_codes and not compressed_optimizer:
            sd = to_adamw_state_dict(sd)
        if not compressed_optimizer:  # CompressedAdamW cuts full tensors itself
            sd = dtensors.shard_like_params(sd, optimizer)
    except Exception as e:  # noqa: BLE001 - nothing is modified yet
        raise CheckpointError(f"{url}: cannot convert the state for {type(optimizer).__name__} ({e})") from e
    before = _snapshot(optimizer)
    try:
        optimizer.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001 - any refusal, with the optimizer put back as it was
        _restore(optimizer, before)
        raise CheckpointError(f"{url}: the optimizer refused the state dict ({e})") from e
    if model is not None:
        try:
            if local_model:
                rank_read.load_model(model, ckpt.model)
            elif any(dtensors.is_dtensor(t) for t in model.state_dict().values()):
                dtensors.load_model_state_dict(model, ckpt.model)
            else:
                model.load_state_dict(ckpt.model)
        except Exception as e:  # noqa: BLE001 - after every check: a module's own load hook refused
            _restore(optimizer, before)
            raise CheckpointError(
                f"{url}: the model refused its state dict ({e}); the optimizer is unchanged, the model "
                "may be partly loaded"
            ) from e
    return ckpt
