"""Save, load and read optimizer checkpoints (with the model's state dict if wanted).

One safetensors file per checkpoint (or a root file plus shards), through any fsspec URL;
docs/CHECKPOINT.md specifies the layout. CompressedAdamW states are stored as their plain
tensors (codes, scales, exponents); any torch optimizer whose state is tensors and plain values
(torch.optim.AdamW included) is stored the same way, uncompressed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from coatstate import distributed as dtensors
from coatstate.checkpoint import (
    background,
    container,
    encoding,
    rank_cleanup,
    rank_commit,
    rank_read,
    shards,
    storage,
    validate,
    values,
)
from coatstate.checkpoint import extra as run_state
from coatstate.checkpoint import names as param_names
from coatstate.checkpoint.dcp import read_dcp
from coatstate.checkpoint.pt_files import PT_EXTENSIONS, read_pt
from coatstate.formats import schema
from coatstate.formats.optimizer_state import (
    MASTER_CORRECTION,
    MOMENTS,
    is_compressed,
)
from coatstate.formats.schema import CheckpointError
from coatstate.optim import CompressedAdamW, join_master, to_adamw_state_dict

__all__ = ["Checkpoint", "CheckpointError", "load", "read", "read_header", "read_state_dict", "save"]

DEFAULT_SHARD_SIZE = 5 * 2**30
"""Bytes above which a checkpoint is split into shards (as Hugging Face does for weights)."""
READ_ATTEMPTS = 8
"""Roots re-read when a newer save removed a shard mid-read."""


@dataclasses.dataclass(repr=False)
class Checkpoint:
    """What a checkpoint holds, as `coatstate.read` and `coatstate.load` return it.

    Args:
        optimizer (`dict`): the optimizer state dict (`{"state": ..., "param_groups": ...}`),
            tensors on the CPU (DTensors of this rank's rows where `load` read only those).
        model (`dict[str, torch.Tensor]` or `None`): the model state dict saved with it.
        header (`dict`): the JSON header (docs/CHECKPOINT.md); `{}` for a .pt input.
        extra (`dict` or `None`): the run's other state saved with `save(..., extra=)` (scheduler
            state dicts, step, RNG states: plain values and tensors), else None.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
        >>> opt = coatstate.CompressedAdamW(model.parameters(), min_numel=1)
        >>> model(torch.randn(2, 64)).sum().backward(); opt.step()
        >>> coatstate.save(opt, "c.safetensors", model=model)
        >>> ckpt = coatstate.read("c.safetensors")
        >>> ckpt
        Checkpoint(CompressedAdamW, 1 param groups, 4 params with state, 16 optimizer tensors
        (float32 x12, float8_e4m3fn x4), model 4 tensors, 99.8 KiB)
        >>> ckpt.optimizer["state"][0]["exp_avg_codes"].dtype
        torch.float8_e4m3fn
    """

    optimizer: dict[str, Any]
    model: dict[str, torch.Tensor] | None
    header: dict[str, Any]
    extra: dict[str, Any] | None = None

    def __repr__(self) -> str:
        state = self.optimizer.get("state", {})
        tensors = [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        model = [t for t in (self.model or {}).values() if isinstance(t, torch.Tensor)]
        dtypes: dict[str, int] = {}
        for t in tensors:
            name = str(t.dtype).removeprefix("torch.")
            dtypes[name] = dtypes.get(name, 0) + 1
        kind = (self.header.get("optimizer") or {}).get("class") or "optimizer state dict"
        formats = ", ".join(f"{k} x{n}" for k, n in sorted(dtypes.items()))
        nbytes = sum(t.numel() * t.element_size() for t in tensors + model)
        return (
            f"Checkpoint({kind}, {len(self.optimizer.get('param_groups', []))} param groups, "
            f"{len(state)} params with state, {len(tensors)} optimizer tensors ({formats or 'none'}), "
            f"model {'None' if self.model is None else f'{len(model)} tensors'}, {_size(nbytes)})"
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------------------------------ saving
def header_shapes(header: Mapping[str, Any]) -> dict[int, list[int]]:
    """{param id: shape} that a checkpoint's header records (4-bit moments need them to decode)."""
    params = header.get("params") or {}
    return {
        int(k): v["shape"] for k, v in params.items() if isinstance(v, dict) and v.get("shape") is not None
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
    extra: Mapping[str, Any] | None = None,
) -> background.SaveHandle | None:
    """Write an optimizer's state (and optionally its model's) to `url`, atomically.

    The state of CompressedAdamW is stored as its plain tensors (FP8 codes, scales, exponents);
    any other torch optimizer whose state is tensors and plain values (torch.optim.AdamW
    included) is stored the same way, uncompressed. A crash mid-save leaves the previous file as
    it was. The directory of `url` (and its parents) is made when missing.

    Args:
        optimizer_or_state_dict (`torch.optim.Optimizer` or `Mapping`): the optimizer, or its
            state dict (a mapping with "state" and "param_groups").
        url (`str` or `os.PathLike`): a local path or any fsspec URL (file://, memory://, s3://).
        model (`torch.nn.Module` or `Mapping[str, torch.Tensor]`, *optional*): stored in the same
            file, so one file resumes a run; an nn.Module also records the parameter names.
        compress (`str`, *optional*, defaults to `None`): `"zstd"` compresses each tensor on its
            own (needs `pip install zstandard`; off by default: FP8 codes compress little, see
            docs/CHECKPOINT.md).
        shard_size (`int`, *optional*, defaults to 5 GiB): above this many bytes the tensors go
            to shard files next to `url`, and `url` holds their index; `None`: never shard.
        param_names (`Mapping[int, str]` or `list[str]`, *optional*): names of the parameters by
            param id, where neither `model` nor the optimizer's groups give them.
        blocking (`bool`, *optional*, defaults to `True`): `False` snapshots the state (CUDA
            tensors into pinned host memory) and returns at once; a background thread writes and
            commits the file. The next save, `SaveHandle.wait()` or interpreter exit waits for it
            and raises (at exit: logs, and exits with status 1) what it raised.
        distributed (`str`, *optional*, defaults to `"gathered"`): `"gathered"` all-gathers DTensor
            (FSDP2) states and rank 0 writes one file (every rank calls save; DDP: rank 0 only);
            `"per_rank"`: every rank writes its own rows to its own file and rank 0 the root at
            `url` (the commit point); loads at any world size; no zstd, no shard_size.
        extra (`Mapping[str, Any]`, *optional*): the rest of the run's state, in the same file:
            scheduler state dicts, the step, the data position, RNG states (`torch.get_rng_state()`);
            values are None, bool, int, float, str, lists, tuples, dicts and tensors (stored as
            tensors, never pickled). `read` and `load` return it as `Checkpoint.extra`.

    Returns:
        `SaveHandle` when `blocking=False` (`wait()`, `done()`), else `None`.

    Raises:
        ValueError: a bad `compress`, `shard_size` or `distributed`, or a combination that does
            not apply (the message names the fix).
        TypeError: `optimizer_or_state_dict` is neither an optimizer nor a state dict.
        CheckpointError: a distributed save that another rank could not write.
        OSError: the file cannot be written (a parent that is a file, no permission, no space).
        RuntimeError: the previous background save failed (raised here, before anything is written).

    Example:
        >>> opt = coatstate.CompressedAdamW(model.parameters(), lr=3e-4)
        >>> coatstate.save(opt, "run/step1000.safetensors", model=model)
        >>> handle = coatstate.save(opt, "s3://bucket/run/step2000.safetensors", blocking=False)
        >>> handle.wait()  # or let the next save wait for it
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
    if extra is not None and distributed == "per_rank":
        raise ValueError(
            "extra= is not available with distributed='per_rank' yet: save the run state with "
            "distributed='gathered', or in a file of its own from rank 0"
        )
    url = os.fspath(url)  # resolved by the rank that writes (_write, rank_commit._start)
    # every save waits for the one in flight (whose failure is raised here, before anything else):
    # two saves of one process never race for a file, nor for the per-rank pinned buffers
    background.wait_for_saves()
    sd, shapes, names, kind = encoding.source(optimizer_or_state_dict, model, param_names)
    model_sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if distributed == "per_rank":
        tensors, header = encoding.flatten(
            sd, shapes, names, model_sd, prepare=torch.Tensor.detach, checksums=False
        )
        header["optimizer"]["class"] = kind
        encoding.check_writable(header, url)
        return rank_commit.save(url, tensors, header, encoding.metadata, blocking)
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
        (sd, model_sd, extra), ready = background.snapshot((sd, model_sd, extra))
        return background.start(
            url, lambda: _write(url, sd, shapes, names, kind, model_sd, compress, shard_size, extra), ready
        )
    if not sharded:
        _write(url, sd, shapes, names, kind, model_sd, compress, shard_size, extra)
        return None
    # FSDP2/DTensor: gather every tensor (a collective), rank 0 writes, every rank learns how it went
    sd = dtensors.gather_state_dict(sd)
    if model_sd:
        model_sd = {k: dtensors.full_tensor(v).detach().cpu() for k, v in model_sd.items()}
    error = None
    if dtensors.is_main_process():
        try:
            _write(url, sd, shapes, names, kind, model_sd, compress, shard_size, extra)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks are told
            error = e
    failed = dtensors.broadcast_from_main(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"{url}: rank 0 could not write the checkpoint ({failed})")
    return None


def _write(url, sd, shapes, names, kind, model_sd, compress, shard_size, extra=None) -> None:
    url = storage.locate(url)  # resolved once: every function below takes the Location
    storage.check_directory(url)
    tensors, header = encoding.flatten(sd, shapes, names, model_sd, extra=extra)
    header["optimizer"]["class"] = kind
    encoding.check_writable(header, url)
    stored = encoding.encode_zstd(tensors, header) if compress == "zstd" else tensors
    try:
        previous = shards.write(url, stored, header, shard_size, encoding.metadata)
    except CheckpointError as e:  # (the container's own checks do not know the file's name)
        if str(e).startswith(url):
            raise
        raise CheckpointError(f"{url}: {e}") from None
    if previous is not None and rank_read.is_per_rank(previous):  # its rank files are orphans now
        rank_cleanup.after_commit(url, None, previous)


# ----------------------------------------------------------------------------------- reading
def read_header(url: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a checkpoint, reading only the first bytes of the file.

    Args:
        url (`str` or `os.PathLike`): a coatstate .safetensors file (a root, for shards or ranks).

    Returns:
        `dict`: the header (docs/CHECKPOINT.md, "Metadata"), its checksum and schema checked.

    Raises:
        CheckpointError: not a coatstate checkpoint, or a corrupt header.
        FileNotFoundError: nothing at `url`.

    Example:
        >>> coatstate.checkpoint.read_header("run/step1000.safetensors")["optimizer"]
        {'class': 'CompressedAdamW', 'variant': 'compressed'}
    """
    url = storage.locate(url)  # resolved once: every function below takes the Location
    _, _, st_header = container.read_head(url, url)
    return container.coatstate_header(st_header, url)


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
        tensors = encoding.decode(stored, header, url, verify)
        groups = [schema.decode_value(g, tensors) for g in header["param_groups"]]
        state = {int(pid): schema.decode_value(s, tensors) for pid, s in header["state"].items()}
        model = None
        if header.get("model") is not None:
            model = {name: tensors[schema.model_key(name)] for name in header["model"]}
        extra = run_state.decode(header.get("extra"), tensors)
    except CheckpointError as e:
        if str(e).startswith(url):
            raise
        raise CheckpointError(f"{url}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{url}: malformed header ({e!r})") from None
    return Checkpoint(
        optimizer={"state": state, "param_groups": groups}, model=model, header=header, extra=extra
    )


def read(url: str | os.PathLike, *, verify: bool = True, key: str | None = None) -> Checkpoint:
    """Everything in a checkpoint, checksums verified; no optimizer needed.

    Also reads a torch.save'd optimizer state dict (.pt/.pth/.bin, or any file that starts as a
    zip) with `torch.load(weights_only=True)`, and a local torch.distributed.checkpoint directory
    (whole tensors, any world size; its `header` then lists only the parameter names and shapes).
    Nothing is ever unpickled.

    Args:
        url (`str` or `os.PathLike`): a checkpoint file, a .pt file or a DCP directory.
        verify (`bool`, *optional*, defaults to `True`): check every tensor's checksum.
        key (`str`, *optional*): in a torch.save'd dict, the entry holding the optimizer state
            dict (found without it when exactly one entry is one, as in `{"model": ...,
            "optimizer": ..., "step": ...}`; the model's comes with it from "model").

    Returns:
        `Checkpoint`: the optimizer state dict, the model state dict (or None) and the header.

    Raises:
        CheckpointError: anything wrong with the input (truncated, corrupt, wrong version, a
            missing shard, not a regular file), naming the file and the problem.
        FileNotFoundError: nothing at `url`.

    Example:
        >>> ckpt = coatstate.read("run/step1000.safetensors")
        >>> lr = ckpt.optimizer["param_groups"][0]["lr"]
        >>> weights = ckpt.model  # None unless saved with model=
    """
    url = storage.locate(url)  # resolved once: every function below takes the Location
    try:
        if os.path.isdir(url):
            return _read_dcp(url)
        for _ in range(READ_ATTEMPTS):
            data = storage.read_bytes(url)
            if data[:4] == b"PK\x03\x04" or os.path.splitext(url)[1].lower() in PT_EXTENSIONS:
                optimizer, model = read_pt(data, url, key)
                return Checkpoint(optimizer=optimizer, model=model, header={})
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
    """The optimizer state dict stored at `url` (checksums verified): `read(url).optimizer`.

    Example:
        >>> torch.optim.AdamW(model.parameters()).load_state_dict(
        ...     coatstate.optim.to_adamw_state_dict(coatstate.checkpoint.read_state_dict(url)))
    """
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


def _header_of(url: storage.Location) -> dict[str, Any] | None:
    """The header of a coatstate file, or None for a .pt, a DCP directory or anything else (read
    then says what it is)."""
    if os.path.isdir(url) or os.path.splitext(url)[1].lower() in PT_EXTENSIONS:
        return None
    try:
        return read_header(url)
    except CheckpointError:
        return None


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
    (the optimizer refuses the state) leaves the optimizer and model as they were. A compressed
    checkpoint loaded into a plain torch optimizer is decompressed first (the values
    CompressedAdamW used, in fp32). bfloat16 weights with master corrections loaded into float32
    parameters are joined into their float32 masters (needs `model`). With DTensor (FSDP2)
    parameters every rank keeps its own rows, whatever world size saved the file: of a per-rank
    checkpoint it reads only those rows, of a single file the whole file.

    Args:
        optimizer (`torch.optim.Optimizer`): CompressedAdamW, torch.optim.AdamW, or the class that
            saved the file (or a subclass), over parameters shaped as the saved ones.
        url (`str` or `os.PathLike`): a checkpoint file, a .pt optimizer state dict or a local
            torch.distributed.checkpoint directory.
        model (`torch.nn.Module`, *optional*): loaded from the model state dict in the file.

    Returns:
        `Checkpoint`: what was read (the header holds e.g. the library version that wrote it).

    Raises:
        CheckpointError: a problem with the file, or a mismatch with `optimizer` or `model`
            (another optimizer class, param counts, a shape, model keys or dtypes), naming it.
        FileNotFoundError: nothing at `url`.

    Example:
        >>> opt = coatstate.CompressedAdamW(model.parameters(), lr=3e-4)
        >>> coatstate.load(opt, "run/step1000.safetensors", model=model)
        Checkpoint(CompressedAdamW, 1 param groups, 4 params with state, ...)
    """
    url = storage.locate(url)  # resolved once: every function below takes the Location
    names = param_names.optimizer_names(optimizer, model)
    header = _header_of(url)
    if header is not None:  # shapes checked before a tensor is read (or a zstd frame inflated)
        param_names.check_header_first(header, optimizer, model, names, url)
    ckpt = _read_for(optimizer, url, model)
    local_model = ckpt.model is not None and any(dtensors.is_dtensor(t) for t in ckpt.model.values())
    ckpt = param_names.by_name(ckpt, optimizer, names, url)  # never another parameter's moments
    if model is not None:
        ckpt = param_names.model_keys(ckpt, model, url)
    ckpt = _join_masters(optimizer, model, ckpt, names, url)
    sd = ckpt.optimizer
    has_codes = any(is_compressed(s, name) for s in sd["state"].values() for name in MOMENTS)
    compressed_optimizer = isinstance(optimizer, CompressedAdamW)
    saved_class = (ckpt.header.get("optimizer") or {}).get("class")
    validate.check_class(optimizer, saved_class, has_codes, compressed_optimizer, url)
    validate.check_optimizer(optimizer, ckpt, names, url)
    values.check_values(sd, url)  # steps, scales, exponents: what the header cannot say
    if model is not None:
        validate.check_model(model, ckpt.model, url)
        values.check_model_writable(model, url)
    try:
        if has_codes and not compressed_optimizer:
            sd = to_adamw_state_dict(sd, header_shapes(ckpt.header))
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
