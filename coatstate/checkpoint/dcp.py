"""Reading torch.distributed.checkpoint directories (without torch.distributed, without pickle).

A DCP directory's .metadata is a pickle. It is read with an unpickler that builds only DCP's
own metadata dataclasses, torch.Size, dtypes, layouts and paths (anything else is refused), and
its tensors and small values with torch.load(weights_only=True): nothing runs code from the file.

The metadata is then trusted for nothing: before a byte is allocated, every tensor's chunks
must tile it exactly (no gap, which would return uninitialised memory, and no overlap), every
chunk and value must name a regular file inside the directory (no `..`, no absolute path, no
symlink out) with its bytes inside that file, and no two items may share bytes, so a tensor
never claims more memory than the files hold. Any violation is a CheckpointError.
"""

from __future__ import annotations

import io
import math
import os
import stat
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from coatstate.checkpoint import storage
from coatstate.formats.schema import CheckpointError

_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
MAX_CHUNKS = 1 << 16
"""Chunks per tensor (one per rank that held a piece): more than any real run writes."""
MAX_PATH_DEPTH = 64
"""Keys in one planner_data path (the nesting of the saved state dict)."""


def _allowed_global(module: str, name: str) -> bool:
    import importlib
    import inspect

    if (module, name) in _DCP_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.distributed.checkpoint.metadata":
        obj = getattr(importlib.import_module(module), name, None)
        return inspect.isclass(obj) and obj.__module__ == module
    return False


def _read_dcp_metadata(data: bytes, where: str) -> Any:
    import pickle

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _allowed_global(module, name):
                raise CheckpointError(
                    f"{where}: .metadata refers to {module}.{name}, which is not a checkpoint metadata type; "
                    "refusing to unpickle it"
                )
            return super().find_class(module, name)

    try:
        return _Restricted(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as e:  # allowed classes called with bad arguments, truncation, bad opcodes
        raise CheckpointError(f"{where}: corrupt .metadata ({type(e).__name__}: {str(e)[:200]})") from None


# ------------------------------------------------------------------------------- validation
def _size(v: Any, ndim: int | None = None) -> tuple[int, ...] | None:
    if not isinstance(v, (torch.Size, tuple, list)) or len(v) > 64 or (ndim is not None and len(v) != ndim):
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        return None
    return tuple(v)


def _check_tiling(fqn: str, size: tuple[int, ...], chunks: list, fail) -> None:
    """The chunks cover the tensor exactly: inside it, volumes summing to its numel, no overlap."""
    boxes = []
    for c in chunks:
        offsets, sizes = (
            _size(getattr(c, "offsets", None), len(size)),
            _size(getattr(c, "sizes", None), len(size)),
        )
        if offsets is None or sizes is None:
            fail(f"tensor {fqn!r}: a chunk's offsets/sizes are not {len(size)} non-negative ints")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            fail(
                f"tensor {fqn!r}: chunk at {list(offsets)} of size {list(sizes)} lies outside its shape "
                f"{list(size)}"
            )
        boxes.append((offsets, sizes))
    volume = sum(math.prod(s) for _, s in boxes)
    if volume != math.prod(size):
        fail(
            f"tensor {fqn!r} of shape {list(size)} has {math.prod(size)} elements but its chunks hold "
            f"{volume}: the chunks do not cover it exactly"
        )
    full = [b for b in boxes if math.prod(b[1])]
    if len(full) > 1 and size:
        lo = torch.tensor([o for o, _ in full], dtype=torch.int64)
        hi = lo + torch.tensor([s for _, s in full], dtype=torch.int64)
        for i in range(0, len(full), 1024):  # pairwise, in blocks to bound the memory
            overlap = ((lo[i : i + 1024, None] < hi[None]) & (lo[None] < hi[i : i + 1024, None])).all(-1)
            overlap &= torch.arange(i, i + overlap.shape[0])[:, None] < torch.arange(len(full))[None]
            if overlap.any():
                fail(f"tensor {fqn!r}: two chunks overlap")
    elif len(full) > 1:
        fail(f"tensor {fqn!r}: a scalar with more than one chunk")


class _Files:
    """The directory's data files, opened once each after checking that they stay inside it."""

    def __init__(self, path: str, fail):
        self.root = os.path.realpath(path)
        self.fail = fail
        self.fds: dict[str, tuple[int, int]] = {}

    def open(self, relative: Any) -> tuple[int, int, str]:
        """(descriptor, size, real path) of a data file named relative to the directory."""
        if not isinstance(relative, (str, os.PathLike)):
            self.fail(f"a storage entry names {type(relative).__name__} {relative!r:.60} as its file")
        rel = os.fspath(relative)
        parts = rel.replace("\\", "/").split("/")
        if not rel or "\x00" in rel or os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts:
            self.fail(f"a storage entry names {rel!r:.100}, which is not a file inside the directory")
        full = os.path.realpath(os.path.join(self.root, rel))
        if os.path.commonpath([self.root, full]) != self.root:
            self.fail(f"storage file {rel!r:.100} resolves to {full}, outside the directory")
        if full in self.fds:
            return (*self.fds[full], full)
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            self.fail(f"cannot open storage file {rel!r:.100} ({e.strerror or e})")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self.fail(f"storage file {rel!r:.100} is not a regular file")
        self.fds[full] = (fd, st.st_size)
        return fd, st.st_size, full

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)


def _validated(metadata: Any, files: _Files, fail) -> tuple[list, dict]:
    """[(fqn, kind, properties/size/chunks, [storage info...])], planner paths, from checked metadata."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        fail(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
    storage_data = metadata.storage_data
    if not isinstance(storage_data, dict) or not all(
        type(k) is MetadataIndex and type(v) is _StorageInfo for k, v in storage_data.items()
    ):
        fail("storage_data must map MetadataIndex to _StorageInfo entries")
    paths = metadata.planner_data if metadata.planner_data is not None else {}
    if not isinstance(paths, dict):
        fail("planner_data must be a dict of key paths")
    items, regions = [], {}

    def info_for(index: MetadataIndex, what: str, least: int) -> _StorageInfo:
        info = storage_data.get(index)
        if info is None:
            fail(f"{what} has no storage entry")
        offset, length = info.offset, info.length
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length)):
            fail(f"{what}: storage offset/length must be non-negative ints")
        if getattr(info, "transform_descriptors", None):
            fail(
                f"{what} is stored through transforms {info.transform_descriptors!r:.80}, which this "
                "reader does not apply"
            )
        _, file_size, full = files.open(info.relative_path)
        if offset + length > file_size:
            fail(
                f"{what} claims bytes {offset}..{offset + length} of {os.fspath(info.relative_path)!r:.80}, "
                f"which has {file_size}: truncated or corrupt"
            )
        if least > length:
            fail(f"{what} needs at least {least} bytes but its storage entry holds {length}")
        regions.setdefault(full, []).append((offset, length, what))
        return info

    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            fail(f"key {fqn!r:.60} is not a string")
        if type(md) is TensorStorageMetadata:
            items.append(_tensor_item(fqn, md, info_for, fail))
        elif type(md) is BytesStorageMetadata:
            items.append((fqn, None, [info_for(MetadataIndex(fqn), f"value {fqn!r}", 0)]))
        else:
            fail(f"key {fqn!r}: {type(md).__name__} is not a DCP storage type")
        _check_path(fqn, paths.get(fqn, (fqn,)), fail)
    _check_overlaps(regions, fail)
    return items, paths


def _tensor_item(fqn: str, md: Any, info_for, fail) -> tuple:
    """(fqn, (dtype, size, chunks), storage infos) of a checked tensor entry."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties

    props, size = md.properties, _size(md.size)
    if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
        fail(f"tensor {fqn!r}: properties must give a torch dtype")
    if props.layout != torch.strided or size is None:
        fail(f"tensor {fqn!r}: must be a strided tensor with a shape of non-negative ints")
    chunks = md.chunks
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        fail(f"tensor {fqn!r}: chunks must be a list of at most {MAX_CHUNKS}")
    if not all(type(c) is ChunkStorageMetadata for c in chunks):
        fail(f"tensor {fqn!r}: chunks must be ChunkStorageMetadata")
    _check_tiling(fqn, size, chunks, fail)
    itemsize = props.dtype.itemsize
    infos = [
        info_for(MetadataIndex(fqn, c.offsets), f"tensor {fqn!r} chunk at {list(c.offsets)}",
                 math.prod(c.sizes) * itemsize)
        for c in chunks
    ]  # fmt: skip
    return fqn, (props.dtype, size, chunks), infos


def _check_path(fqn: str, path: Any, fail) -> None:
    if not (
        isinstance(path, (tuple, list))
        and 0 < len(path) <= MAX_PATH_DEPTH
        and all(
            isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and k >= 0) for k in path
        )
    ):
        fail(f"planner_data path of {fqn!r} must be a short list of str keys and list indices")


def _check_overlaps(regions: dict, fail) -> None:
    """Two items sharing bytes could claim the same bytes twice."""
    for rel, spans in regions.items():
        spans.sort()
        for (a, la, wa), (b, _, wb) in zip(spans, spans[1:], strict=False):
            if a + la > b:
                fail(f"{wa} and {wb} share bytes of {os.path.basename(rel)!r:.80}")


def load_failure(e: BaseException) -> str:
    """Why torch.load(weights_only=True) refused, without torch's advice to retry unsafely."""
    reason = str(e)
    if "WeightsUnpickler error:" in reason:
        reason = reason.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    return " ".join(reason.split())[:300]


def weights_only_load(data: bytes) -> Any:
    """torch.load(weights_only=True) of bytes, silently: its warnings about what it refuses would
    be a second line beside the one CheckpointError the caller raises for the same problem."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _load_slice(files: _Files, info, where: str, fail) -> Any:
    fd, _, _ = files.open(info.relative_path)
    blob = os.pread(fd, info.length, info.offset)
    if len(blob) != info.length:
        fail(f"{where}: the file shrank while being read")
    try:
        return weights_only_load(blob)
    except Exception as e:  # weights_only refuses pickled code; a torn record fails its size check
        fail(f"{where}: unreadable with torch.load(weights_only=True) ({load_failure(e)})")


class _Node(dict):
    """A dict of the state dict being rebuilt from planner_data paths (not a loaded value)."""


class _Indexed(dict):
    """A list being rebuilt from its items' indices (DCP flattens lists into int path keys)."""


def _set_path(root: dict, path: tuple, value: Any, fail) -> None:
    node: Any = root
    for key, nxt in zip(path, path[1:], strict=False):
        if isinstance(key, int) != isinstance(node, _Indexed):
            fail(f"planner_data path {list(path)!r:.100} conflicts with another key's")
        node = node.setdefault(key, _Indexed() if isinstance(nxt, int) else _Node())
        if type(node) is not (_Indexed if isinstance(nxt, int) else _Node):
            fail(f"planner_data path {list(path)!r:.100} conflicts with another key's")
    last = path[-1]
    if isinstance(last, int) != isinstance(node, _Indexed) or last in node:
        fail(f"planner_data path {list(path)!r:.100} conflicts with another key's")
    node[last] = value


def _lists(node: Any, fail) -> Any:
    """_Indexed -> list (its indices must be 0..n-1), all the way down (depth <= MAX_PATH_DEPTH)."""
    if isinstance(node, _Indexed):
        if sorted(node) != list(range(len(node))):
            fail(f"a list in the state dict has entries {sorted(node)[:5]}..., not 0..{len(node) - 1}")
        return [_lists(node[i], fail) for i in range(len(node))]
    if type(node) is _Node:
        return {k: _lists(v, fail) for k, v in node.items()}
    return node


def read_metadata(path: str, fail) -> Any:
    """The DCP Metadata of directory `path`, through the restricted unpickler (not yet checked)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        fail("a directory without .metadata is not a complete torch.distributed.checkpoint")
    from fsspec.implementations.local import LocalFileSystem

    local = os.path.join(path, ".metadata")  # (a local path: no URL to resolve again)
    return _read_dcp_metadata(storage.read_bytes(storage.Location(local, LocalFileSystem(), local)), path)


def read_flat(path: str, fail) -> dict[str, Any]:
    """{key: whole tensor or value} of every entry, the metadata checked first."""
    return _read_items(path, fail)[0]


def _read_items(path: str, fail) -> tuple[dict[str, Any], dict]:
    metadata = read_metadata(path, fail)
    files = _Files(path, fail)
    try:
        items, paths = _validated(metadata, files, fail)
        flat = {}
        for fqn, tensor, infos in items:
            if tensor is None:
                flat[fqn] = _load_slice(files, infos[0], f"value {fqn!r}", fail)
                continue
            dtype, size, chunks = tensor
            value = torch.empty(size, dtype=dtype)  # every element is written: the chunks tile it
            for c, info in zip(chunks, infos, strict=True):
                where = f"tensor {fqn!r} chunk at {list(c.offsets)}"
                t = _load_slice(files, info, where, fail)
                if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(c.sizes):
                    got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    fail(f"{where}: holds {got}, expected {dtype} {list(c.sizes)}")
                value[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = t
            flat[fqn] = value
        return flat, paths
    finally:
        files.close()


def _read(path: str, fail) -> dict[str, Any]:
    flat, paths = _read_items(path, fail)
    sd = _Node()
    for fqn, value in flat.items():
        _set_path(sd, tuple(paths.get(fqn, (fqn,))), value, fail)
    return _lists(sd, fail)


def read_dcp(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None, dict[int, str]]:
    """(optimizer state dict with int param ids, model state dict or None, {param id: FQN}) from
    a torch.distributed.checkpoint directory written at any world size (tensors come back whole).

    The optimizer state dict is the entry of the saved mapping that has 'state' and
    'param_groups' (as get_state_dict makes it, keyed by parameter name); the model state dict
    is the entry named 'model', if any.
    """

    def fail(problem: str):
        raise CheckpointError(f"{path}: {problem}")

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"{path}: a directory without .metadata is not a torch.distributed.checkpoint (coatstate reads "
            "DCP directories, their .metadata pickle through a restricted unpickler)"
        )
    sd = _read(path, fail)
    if "state" in sd and "param_groups" in sd:
        osd = sd
    else:
        found = [v for v in sd.values() if isinstance(v, Mapping) and "state" in v and "param_groups" in v]
        if len(found) != 1:
            raise CheckpointError(
                f"{path}: expected one optimizer state dict (a mapping with 'state' and 'param_groups') in "
                f"the DCP checkpoint; found {len(found)} among its keys {sorted(sd)[:10]}"
            )
        osd = found[0]
    model = sd.get("model") if isinstance(sd.get("model"), Mapping) else None
    optimizer, names = _by_index(osd, fail)
    return optimizer, (dict(model) if model is not None else None), names


def _by_index(osd: Mapping[str, Any], fail) -> tuple[dict[str, Any], dict[int, str]]:
    """An optimizer state dict keyed by parameter name (get_state_dict's) -> torch's int ids."""
    groups, state = osd["param_groups"], osd["state"]
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        fail("param_groups must be a list of dicts with a 'params' list")
    if not isinstance(state, dict):
        fail("the optimizer's 'state' must be a dict")
    names = [n for g in groups for n in g["params"]]
    if len(set(map(repr, names))) != len(names):
        fail("a parameter is listed twice in param_groups")
    if all(isinstance(n, int) and not isinstance(n, bool) for n in names):
        return {"state": dict(state), "param_groups": [dict(g) for g in groups]}, {}
    if not all(isinstance(n, str) for n in names):
        fail("param_groups' params must be all parameter names or all int ids")
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(state) - set(index))
    if unknown:
        fail(f"state for {unknown[:3]}, which no param group lists")
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    return {"state": {index[n]: s for n, s in state.items()}, "param_groups": groups}, {
        i: n for n, i in index.items()
    }
