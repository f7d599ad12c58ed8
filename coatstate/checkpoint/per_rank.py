"""Per-rank checkpoints on torch.distributed.checkpoint: `coatstate.save(..., distributed="per_rank")`.

A per-rank checkpoint at URL is a directory of versions. Every save writes a new version,
`URL/{n:08d}-{id}/`, which is a plain DCP checkpoint: DCP's planner decides who writes what
(every rank its own shards, a replicated tensor once), FileSystemWriter writes one file per rank
and then rank 0 writes `.metadata` under a temporary name and renames it into place. That
rename is the commit: a version without `.metadata` is an unfinished save and is never read.
Only after its own commit does rank 0 remove the versions older than its own. So a save never
touches the last complete checkpoint before it is complete itself, and it writes and removes
only inside URL: a renamed directory takes all its files with it, and nothing outside URL is
ever matched by name (defects 3 and 11 of issue 48).

Tensors are stored under the keys of the single file (`state/{id}/{name}`, `model/{name}`),
beside one string, the coatstate JSON header (without checksums: DCP stores none). Reading
never unpickles: `.metadata` goes through dcp.py's restricted unpickler and checks, and tensors
and the header through `torch.load(weights_only=True)`. `load` into DTensor parameters hands
DCP targets cut as this rank's parameters are, so DCP reads only this rank's rows, at any world
size (resharding); every other reader gets whole tensors.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
import warnings
from typing import Any

import torch

from coatstate import distributed
from coatstate.checkpoint import background, dcp, storage, validate
from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError

HEADER_KEY = "coatstate.header"
"""The DCP key of the JSON header (a string; every other key is a tensor of the header)."""
VERSION = re.compile(r"(\d{8})-[0-9a-f]{12}")
"""A version directory's name: a counter (the order of saves) and a random id (two saves that
picked the same counter at once still write apart)."""
READ_ATTEMPTS = 4
"""Reads of `latest(url)` again when a newer save removed the version being read."""
_async_groups: dict[int, Any] = {}


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _directory(url: str) -> str:
    """The local directory of per-rank checkpoint `url` (DCP's FileSystemWriter writes local files)."""
    location = storage.locate(url)
    if not storage.is_local(location.fs):
        raise ValueError(
            f"cannot save per-rank to {url}: distributed='per_rank' writes through torch.distributed."
            "checkpoint's FileSystemWriter, which needs a (shared) local filesystem; save a single file "
            "with distributed='gathered' to an fsspec URL, or mount the store"
        )
    return os.path.abspath(location.path)


def _versions(path: str) -> list[str]:
    """Version directories under `path`, oldest first (complete or not)."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if VERSION.fullmatch(n) and os.path.isdir(os.path.join(path, n)))


def _complete(version: str) -> bool:
    return os.path.isfile(os.path.join(version, ".metadata"))


def latest(url: str | os.PathLike) -> str:
    """The DCP directory a read of `url` uses: `url` itself when it holds `.metadata` (a plain
    DCP checkpoint, or one version), else its newest complete version.

    Example:
        >>> dcp.load(state, checkpoint_id=coatstate.checkpoint.per_rank.latest("run/ckpt"))
    """
    path = os.path.abspath(os.fspath(url))
    if _complete(path):
        return path
    versions = _versions(path)
    complete = [v for v in versions if _complete(os.path.join(path, v))]
    if complete:
        return os.path.join(path, complete[-1])
    unfinished = f" ({len(versions)} unfinished saves: killed, or still writing)" if versions else ""
    raise CheckpointError(
        f"{url}: a directory without .metadata and without a complete version{unfinished}: not a "
        "torch.distributed.checkpoint; load an earlier checkpoint, or save again (a save commits by "
        "writing .metadata last)"
    )


def _prune(path: str, keep: str) -> None:
    """Remove the versions older than `keep` (after its commit; best effort)."""
    for name in _versions(path):
        if name < keep:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def _new_version(url: str, path: str) -> str:
    """Rank 0 names the next version (after every existing one) and tells the others."""
    dist = _dist()
    name = None
    if dist is None or dist.get_rank() == 0:
        try:
            if os.path.exists(path) and not os.path.isdir(path):
                raise NotADirectoryError(f"cannot save per-rank to {url}: it is a file, not a directory")
            os.makedirs(path, exist_ok=True)
            versions = _versions(path)
            counter = int(VERSION.fullmatch(versions[-1]).group(1)) + 1 if versions else 1
            name = f"{counter:08d}-{uuid.uuid4().hex[:12]}"
        except OSError as e:
            name = e
    name = distributed.broadcast_from_main(name)
    if isinstance(name, BaseException):
        raise name if dist is None or dist.get_rank() == 0 else OSError(f"rank 0: {name}")
    return os.path.join(path, name)


def _async_group():
    """A gloo group of its own for the background save's collectives, which would otherwise
    interleave with the training loop's on the default group (made once, by every rank)."""
    dist = _dist()
    if dist is None:
        return None
    key = id(dist.group.WORLD)
    if key not in _async_groups:
        _async_groups[key] = dist.new_group(backend="gloo")
    return _async_groups[key]


def save(
    url: str, tensors: dict[str, torch.Tensor], header: dict[str, Any], blocking: bool
) -> background.SaveHandle | None:
    """Save `tensors` (DTensors stay sharded) and `header` as a new version of `url`; a collective."""
    import torch.distributed.checkpoint as dcp_api
    from torch.distributed.checkpoint import FileSystemWriter

    path = _directory(url)
    header["checksum"] = None  # DCP stores no checksums
    state: dict[str, Any] = dict(tensors)
    state[HEADER_KEY] = schema.dump_header(header)
    version = _new_version(url, path)
    main, no_dist = distributed.is_main_process(), _dist() is None

    def write(state: dict[str, Any]) -> None:
        with _single_process_quiet(no_dist), _ranks_failed(url, "save"):
            dcp_api.save(state, storage_writer=FileSystemWriter(version, overwrite=False), no_dist=no_dist)
        if main:
            _prune(path, os.path.basename(version))

    if blocking:
        write(state)
        return None
    if no_dist:  # a world of one: our snapshot and thread (DCP's executor would warn about it)
        snapshot, ready = background.snapshot(state)
        return background.start(url, lambda: write(snapshot), ready)
    writer = FileSystemWriter(version, overwrite=False)
    future = dcp_api.async_save(state, storage_writer=writer, process_group=_async_group())
    future = getattr(future, "upload_completion", future)

    def commit() -> None:
        with _ranks_failed(url, "save"):
            future.result()
        if main:
            _prune(path, os.path.basename(version))

    return background.start(url, commit, None)


@contextlib.contextmanager
def _ranks_failed(url: str, what: str):
    """DCP's CheckpointException (a BaseException, raised on every rank) as a CheckpointError
    that names the ranks and their errors."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        errors = "; ".join(f"rank {r}: {type(x[0]).__name__}: {x[0]}" for r, x in sorted(e.failures.items()))
        previous = " (the previous checkpoint stays the one a load reads)" if what == "save" else ""
        raise CheckpointError(f"{url}: the per-rank {what} failed{previous}: {errors[:500]}") from None


@contextlib.contextmanager
def _single_process_quiet(no_dist: bool):
    """DCP warns that it assumes one process when there is no process group: so do we."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# ------------------------------------------------------------------------------------ reading
def _reader(path: str, metadata: Any):
    """DCP's FileSystemReader of `path` that uses `metadata`, read and checked by dcp.py: its own
    read_metadata would unpickle .metadata freely."""
    from torch.distributed.checkpoint import FileSystemReader

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    return CheckedReader(path)


def _head(path: str, url: str) -> tuple[Any, dict[str, Any] | None]:
    """(checked DCP metadata, the coatstate header or None for a DCP checkpoint saved otherwise)."""

    def fail(problem: str):
        raise CheckpointError(f"{url}: {problem}")

    metadata = dcp.read_metadata(path, fail)
    files = dcp._Files(path, fail)
    try:
        items, _ = dcp._validated(metadata, files, fail)
        found = [infos for fqn, tensor, infos in items if fqn == HEADER_KEY and tensor is None]
        if not found:
            return metadata, None
        text = dcp._load_slice(files, found[0][0], f"value {HEADER_KEY!r}", fail)
    finally:
        files.close()
    if not isinstance(text, str):
        fail(f"{HEADER_KEY!r} holds a {type(text).__name__}, not the JSON header")
    header = validate.validate_header(schema.loads_json(text, url, "coatstate header"), url)
    stored = {fqn: (t[0], t[1]) for fqn, t, _ in items if t is not None}
    for key, info in header["tensors"].items():
        if stored.get(key) != (schema.torch_dtype(info["dtype"]), tuple(info["shape"])):
            got = stored.get(key)
            fail(
                f"tensor {key!r} is {info['dtype']} {info['shape']} in the header but "
                f"{'missing' if got is None else f'{got[0]} {list(got[1])}'} in the DCP metadata"
            )
    if set(stored) != set(header["tensors"]):
        fail(f"tensors {sorted(set(stored) - set(header['tensors']))[:3]} are stored but not in the header")
    return metadata, header


def read_header(url: str | os.PathLike) -> dict[str, Any] | None:
    """The header of the checkpoint `latest(url)` names (None: a DCP checkpoint saved otherwise)."""
    return _head(latest(url), os.fspath(url))[1]


def read(url: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """(header, whole tensors) of a per-rank checkpoint; None for a DCP checkpoint saved otherwise
    (dcp.read_dcp reads those). No torch.distributed needed."""
    url = os.fspath(url)

    def fail(problem: str):
        raise CheckpointError(f"{url}: {problem}")

    for _ in range(READ_ATTEMPTS):
        path = latest(url)
        try:
            _, header = _head(path, url)
            if header is None:
                return None
            stored = dcp.read_flat(path, fail)
            stored.pop(HEADER_KEY, None)
            return header, stored
        except (CheckpointError, FileNotFoundError):
            if latest(url) == path:
                raise  # not a newer save that removed this version mid-read
    fail(f"newer saves removed the version being read {READ_ATTEMPTS} times; retry")


def _cut_like(p: torch.Tensor, shape: list[int]) -> bool:
    """Whether a state tensor of global `shape` is cut on dim 0 as DTensor parameter `p` is:
    tensors shaped like p (moments, codes) and (rows, groups) scales of a parameter of rank >= 2."""
    if p.ndim == 0 or not shape or shape[0] != p.shape[0]:
        return False
    return list(shape) == list(p.shape) or (p.ndim >= 2 and len(shape) == 2)


def _target(key: str, info: dict, params: dict[int, torch.Tensor], model_sd: dict) -> torch.Tensor:
    """What DCP loads `key` into: a DTensor cut as the parameter (or model entry) it follows,
    holding only this rank's rows, else a whole tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, dtype = list(info["shape"]), schema.torch_dtype(info["dtype"])
    like = None
    parts = key.split("/", 2)
    if parts[0] == schema.STATE_PREFIX and len(parts) == 3 and parts[2] != "step":
        p = params.get(int(parts[1]))
        if p is not None and distributed.is_dtensor(p) and _cut_like(p, shape):
            like = p
    elif parts[0] == schema.MODEL_PREFIX:
        t = model_sd.get(key[len(schema.MODEL_PREFIX) + 1 :])
        like = t if distributed.is_dtensor(t) and list(t.shape) == shape else None
    if like is None or not all(
        isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in like.placements
    ):
        return torch.empty(shape, dtype=dtype)
    local_shape, _ = compute_local_shape_and_global_offset(shape, like.device_mesh, like.placements)
    return DTensor.from_local(
        torch.empty(local_shape, dtype=dtype),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def read_local(url: str, optimizer, model=None) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """(header, tensors) with only this rank's rows of the states of DTensor parameters (and of
    DTensor model entries), read by DCP from whatever ranks saved them; a collective when a
    process group is up. None for a DCP checkpoint saved otherwise."""
    import torch.distributed.checkpoint as dcp_api

    url = os.fspath(url)
    path = latest(url)
    metadata, header = _head(path, url)
    if header is None:
        return None
    ids = [pid for g in header["param_groups"] for pid in g["params"]]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    params = dict(zip(ids, flat, strict=True)) if len(ids) == len(flat) else {}  # else: refused later
    model_sd = model.state_dict() if model is not None else {}
    targets = {key: _target(key, info, params, model_sd) for key, info in header["tensors"].items()}
    with _single_process_quiet(_dist() is None), _ranks_failed(url, "load"):
        dcp_api.load(targets, storage_reader=_reader(path, metadata), no_dist=_dist() is None)
    return header, targets


def load_model(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy each saved tensor into the model: a DTensor's rows into its local shard."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            src = saved[name]
            if distributed.is_dtensor(t) and not distributed.is_dtensor(src):
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
            distributed.local_tensor(t).copy_(distributed.local_tensor(src))


def stored_bytes(url: str | os.PathLike) -> int:
    """Bytes of the files of the version a read of `url` uses."""
    path = latest(url)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


__all__ = ["HEADER_KEY", "latest", "load_model", "read", "read_header", "read_local", "save", "stored_bytes"]
