"""Per-rank checkpoints, reading: the root's index checked, rows read by range and verified.

A reader needs rows [lo, hi) of a tensor: the root's split says which rank files hold them;
each file's manifest (its sha256 is in the root) gives the checksums of its blocks of rows;
the reader range-reads only the blocks that hold [lo, hi) and checks each one. A whole read
also checks each tensor's checksum in the root (sha256 over its pieces' digests), so every
tensor byte is covered by a checksum chained to the root's header checksum.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from coatstate import distributed
from coatstate.checkpoint import container, rank_files, shards, storage
from coatstate.checkpoint.rank_files import block_rows, num_rows, piece_digest, row_bytes
from coatstate.checkpoint.validate import check_index
from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError

IO_THREADS = 8
"""Range reads in flight at once (reads and sha256 release the GIL)."""


def is_per_rank(header: dict[str, Any]) -> bool:
    return header.get("per_rank") is not None


# ------------------------------------------------------------------------------ rank files
class _File:
    """One rank file's checked head: its data start, safetensors header and manifest."""

    def __init__(self, url: str, root: str, entry: dict[str, Any], index: dict[str, Any], keys: dict):
        self.url = url
        try:
            size = storage.file_size(url)
            if size != entry["bytes"]:  # before it is opened: a FIFO or device never is
                raise CheckpointError(
                    f"{root}: rank file {entry['file']} has {size} bytes, the root says {entry['bytes']}"
                )
            _, self.start, self.st_header = container.read_head(url, url)
        except FileNotFoundError:
            raise shards.ShardMissing(f"{root}: rank file {entry['file']} is missing") from None
        meta = self.st_header.get("__metadata__")
        text = meta.get(rank_files.MANIFEST_KEY) if isinstance(meta, dict) else None
        if not isinstance(text, str) or _sha256_hex(text) != entry["manifest_sha256"]:
            raise CheckpointError(
                f"{root}: checksum mismatch for the manifest of {entry['file']}: the file is corrupt"
            )
        self.manifest = schema.loads_json(text, url, "rank manifest")
        self.data_bytes = size - self.start
        self._check(root, entry, index, keys)

    def _check(self, root: str, entry: dict, index: dict, keys: dict) -> None:
        """The manifest names this save and rank, and holds exactly the rows the root assigns."""
        m, pieces = self.manifest, self.manifest.get("pieces") if isinstance(self.manifest, dict) else None
        if (
            not isinstance(pieces, dict)
            or m.get("save_id") != index["save_id"]
            or m.get("rank") != entry["rank"]
        ):
            raise CheckpointError(f"{root}: {entry['file']} is not the rank file of this save")
        if set(pieces) != set(keys):
            raise CheckpointError(f"{root}: {entry['file']} holds other tensors than the root assigns to it")
        for key, (rows, info) in keys.items():
            p = pieces[key] if isinstance(pieces[key], dict) else {}
            shape, itemsize = info["shape"], schema.DTYPES[info["dtype"]][1]
            n = rows[1] - rows[0]
            sums = p.get("checksums")
            if (
                p.get("rows") != list(rows)
                or p.get("block_rows") != block_rows([n, *shape[1:]], itemsize)
                or not isinstance(sums, list)
                or len(sums) != -(-n // p["block_rows"])
                or not all(isinstance(c, str) for c in sums)
            ):
                raise CheckpointError(
                    f"{root}: the manifest of {entry['file']} disagrees with the root for {key!r}"
                )
            st = self.st_header.get(key) if isinstance(self.st_header.get(key), dict) else {}
            want_shape = [n, *shape[1:]] if shape else []
            if st.get("dtype") != schema.DTYPES[info["dtype"]][0] or st.get("shape") != want_shape:
                raise CheckpointError(
                    f"{root}: {entry['file']} holds {key!r} as {st.get('dtype')} {st.get('shape')}"
                )
            begin, end = container.tensor_span(self.st_header, key, self.data_bytes, self.url)
            if end - begin != n * row_bytes(shape, itemsize):
                raise CheckpointError(
                    f"{root}: {entry['file']} holds {end - begin} bytes of {key!r}, not {n} rows"
                )


class _Reader:
    """Rows of the root's tensors, reading each rank file's head once (on first use)."""

    def __init__(self, url: str, header: dict[str, Any], verify: bool):
        self.url, self.header, self.verify = url, header, verify
        self.index = check_index(header, url)
        self._files: dict[int, _File] = {}
        self._lock = threading.Lock()
        self._keys: dict[int, dict] = {}
        for key, s in self.index["tensor_splits"].items():
            for f, a, b in self.index["splits"][s]:
                self._keys.setdefault(f, {})[key] = ((a, b), header["tensors"][key])

    def file(self, i: int) -> _File:
        with self._lock:
            if i not in self._files:
                entry = self.index["files"][i]
                try:
                    url = storage.sibling_inside(self.url, entry["file"], "rank file")
                    self._files[i] = _File(url, self.url, entry, self.index, self._keys.get(i, {}))
                except CheckpointError as e:  # e.g. from the rank file's own parser: name the root too
                    if str(e).startswith(self.url):
                        raise
                    raise type(e)(f"{self.url}: {e}") from None
                except OSError as e:  # a symlink loop, no permission
                    raise CheckpointError(
                        f"{self.url}: cannot open rank file {entry['file']} ({e.strerror or e})"
                    ) from None
            return self._files[i]

    def pieces(self, key: str) -> list[list[int]]:
        return self.index["splits"][self.index["tensor_splits"][key]]

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of tensor `key` (the whole tensor for a 0-d one), blocks verified."""
        info = self.header["tensors"][key]
        dtype, shape = schema.torch_dtype(info["dtype"]), list(info["shape"])
        wanted = [(f, s, e) for f, s, e in self.pieces(key) if max(lo, s) < min(hi, e)]
        for f, _, _ in wanted:  # first: the files' real sizes then back the shape claimed here
            self.file(f)
        out = torch.empty([hi - lo, *shape[1:]] if shape else [], dtype=dtype)
        per_row = row_bytes(shape, dtype.itemsize)
        dest = schema.tensor_bytes(out) if out.numel() else memoryview(bytearray(0))
        for f, s, e in wanted:
            a, b = max(lo, s) - s, min(hi, e) - s  # rows of this piece that are wanted
            view = dest[(s + a - lo) * per_row : (s + b - lo) * per_row]
            self._piece(self.file(f), key, s, e, a, b, per_row, view)
        return out

    def _piece(
        self, f: _File, key: str, s: int, e: int, a: int, b: int, per_row: int, dest: memoryview
    ) -> None:
        p = f.manifest["pieces"][key]
        step = p["block_rows"]
        r0, r1 = a // step * step, min(-(-b // step) * step, e - s)  # whole blocks around [a, b)
        begin = f.start + container.tensor_span(f.st_header, key, f.data_bytes, f.url)[0] + r0 * per_row
        direct = (r0, r1) == (a, b)
        buf = dest if direct else memoryview(bytearray((r1 - r0) * per_row))
        name = os.path.basename(f.url)
        try:  # the file may have changed since its head was checked (a newer save removes it)
            _read_into(f.url, begin, buf)
        except FileNotFoundError:
            raise shards.ShardMissing(f"{self.url}: rank file {name} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{self.url}: cannot read rank file {name} ({e.strerror or e})") from None
        except CheckpointError as e:
            raise CheckpointError(f"{self.url}: rank file {e}") from None
        if self.verify:
            for j in range(r0 // step, -(-r1 // step)):
                lo, hi = (j * step - r0) * per_row, (min((j + 1) * step, e - s) - r0) * per_row
                if schema.checksum(buf[lo:hi]) != p["checksums"][j]:
                    raise CheckpointError(
                        f"{self.url}: checksum mismatch for rows {s + j * step}.. of {key!r} in "
                        f"{name}: the file is corrupt"
                    )
        if not direct:
            dest[:] = buf[(a - r0) * per_row : (b - r0) * per_row]

    def check_digest(self, key: str) -> None:
        """The root's checksum of `key` against its pieces' manifests (a whole read)."""
        digests = [
            piece_digest(self.file(f).manifest["pieces"][key]["checksums"]) for f, _, _ in self.pieces(key)
        ]
        if rank_files.tensor_digest(digests) != self.header["tensors"][key].get("checksum"):
            raise CheckpointError(
                f"{self.url}: checksum mismatch for tensor {key!r}: its pieces are not the saved ones"
            )


def _sha256_hex(text: str) -> str | None:
    """sha256 of `text` as UTF-8; None for a text that is not (a JSON-escaped lone surrogate)."""
    try:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
    except UnicodeEncodeError:
        return None


def _read_into(url: str, start: int, view: memoryview) -> None:
    """Fill `view` from `url` at byte `start` (a short read is a truncated file)."""
    fs, path = storage.url_to_fs(url)
    got = 0
    if storage.is_local(fs) and hasattr(os, "preadv"):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{url}: not a regular file")
            while got < len(view):
                n = os.preadv(fd, [view[got : got + (1 << 30)]], start + got)
                if n <= 0:
                    break
                got += n
        finally:
            os.close(fd)
    else:
        data = storage.read_range(url, start, len(view))
        view[: len(data)] = data
        got = len(data)
    if got != len(view):
        raise CheckpointError(f"{url}: truncated: {len(view) - got} bytes missing at offset {start + got}")


# -------------------------------------------------------------------------------- entries
def read_all(url: str, header: dict[str, Any], verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of a per-rank checkpoint, whole (what a gathered single file holds)."""
    reader = _Reader(url, header, verify)

    def whole(key: str) -> torch.Tensor:
        if verify:
            reader.check_digest(key)
        return reader.rows(key, 0, num_rows(header["tensors"][key]["shape"]))

    return _parallel(header["tensors"], whole)


def read_tensor(url: str, header: dict[str, Any], key: str) -> torch.Tensor:
    """One whole tensor of a per-rank checkpoint (its blocks verified), reading only its rows."""
    return _Reader(url, header, verify=True).rows(key, 0, num_rows(header["tensors"][key]["shape"]))


def _parallel(keys, fn) -> dict[str, Any]:
    keys = list(keys)
    with ThreadPoolExecutor(max_workers=max(1, min(IO_THREADS, len(keys)))) as pool:
        return dict(zip(keys, pool.map(fn, keys), strict=True))


def _cut_like(p: torch.Tensor, shape: list[int]) -> bool:
    """Whether a state tensor of global `shape` is cut on dim 0 as DTensor parameter `p` is:
    tensors shaped like p (moments, codes) and (rows, groups) scales of a parameter of rank >= 2."""
    if p.ndim == 0 or not shape or shape[0] != p.shape[0]:
        return False
    return list(shape) == list(p.shape) or (p.ndim >= 2 and len(shape) == 2)


def _target(
    key: str, shape: list[int], params: dict[int, torch.Tensor], model_sd: dict
) -> torch.Tensor | None:
    """The DTensor whose rows `key` follows, or None (the tensor is read whole)."""
    parts = key.split("/", 2)
    if parts[0] == schema.STATE_PREFIX and len(parts) == 3 and parts[2] != "step":
        p = params.get(int(parts[1]))
        return p if p is not None and distributed.is_dtensor(p) and _cut_like(p, shape) else None
    if parts[0] == schema.MODEL_PREFIX:
        t = model_sd.get(key[len(schema.MODEL_PREFIX) + 1 :])
        return t if distributed.is_dtensor(t) and list(t.shape) == list(shape) else None
    return None


def read_local(url: str, header: dict[str, Any], optimizer, model=None) -> dict[str, torch.Tensor]:
    """The tensors this rank needs: DTensors of its own rows for the state of DTensor parameters
    (and DTensor model entries), whole tensors for the rest. No collective."""
    from torch.distributed.tensor import DTensor

    reader = _Reader(url, header, verify=True)
    ids = [pid for g in header["param_groups"] for pid in g["params"]]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    params = dict(zip(ids, flat, strict=True)) if len(ids) == len(flat) else {}  # else: refused later
    model_sd = model.state_dict() if model is not None else {}

    def read(key: str) -> torch.Tensor:
        shape = list(header["tensors"][key]["shape"])
        target = _target(key, shape, params, model_sd)
        if target is not None:
            try:
                lo, hi, _ = rank_files.dtensor_rows(target, key)
            except ValueError:
                target = None  # a placement without whole rows: read whole, cut by the loader
        if target is None:
            return reader.rows(key, 0, num_rows(shape))
        local = reader.rows(key, lo, hi)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, target.device_mesh, target.placements, run_check=False, shape=tuple(shape), stride=stride
        )

    return _parallel(header["tensors"], read)


def load_model(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy each saved tensor into the model: a DTensor's rows into its local shard."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            src = saved[name]
            if distributed.is_dtensor(t) and not distributed.is_dtensor(src):
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
            distributed.local_tensor(t).copy_(distributed.local_tensor(src))
