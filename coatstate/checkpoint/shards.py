"""Sharded checkpoints: writing shards and the root (the commit point), removing orphans, reading.

Concurrent saves to one URL each write their own shards (a fresh save id in every name), then
replace the root atomically: the last commit wins and no save overwrites a shard another root
names. After its commit a save removes the shards of its stem that the current root does not
name, that belong to their save (ownership.owned: name and metadata), and whose save is over:
the save it replaced (committed, so final), its own, and on a local filesystem every save whose
lock is free. Each local save holds an exclusive flock on a marker file `.{stem}-{save_id}.saving`
from before its first shard until its commit (the kernel drops the lock of a crashed process),
then releases it and cleans up: so of two concurrent saves, either the loser's cleanup reads the
root after the winner's commit and removes its own shards, or it released its lock before that
commit and the winner's cleanup removes them. Other fsspec filesystems have no such lock: there
a save removes only the shards of the root it replaced and its own if it lost. Readers that
find a shard gone re-read the root (a newer commit removed it) and retry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from typing import Any, BinaryIO

from coatstate.checkpoint import container, ownership, storage
from coatstate.checkpoint.layout import SHARD_KEY, shard_name, shard_pattern, stem_of, temp_shard_pattern
from coatstate.formats.schema import CheckpointError

__all__ = ["SHARD_KEY", "ShardMissing", "read", "remove_orphans", "write"]


class ShardMissing(CheckpointError):
    """A shard the root names is not there (a newer save may have replaced the root)."""


def _marker_pattern(stem: str) -> re.Pattern:
    return re.compile(r"\." + re.escape(stem) + r"-([0-9a-f]{8})\.saving")


class _Hashing:
    def __init__(self, f: BinaryIO):
        self.f, self.h = f, hashlib.sha256()

    def write(self, b) -> int:
        self.h.update(b)
        return self.f.write(b)


# ------------------------------------------------------------------------- the save's lock
class _SaveLock:
    """The exclusive flock a local save holds on its marker (nothing on other filesystems)."""

    def __init__(self, url: str, save_id: str):
        self.fd: int | None = None
        self.path: str | None = None
        fs, path = storage.url_to_fs(url)
        try:
            import fcntl
        except ImportError:  # no flock (Windows): cleaned up as on a remote filesystem
            return
        if not storage.is_local(fs):
            return
        directory = os.path.dirname(path) or "."
        self.path = os.path.join(directory, f".{stem_of(url)}-{save_id}.saving")
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
        # locked before it has its name: a cleaner never sees this marker unlocked while we run
        self.fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.replace(tmp, self.path)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def _save_is_over(directory: str, stem: str, save_id: str, held: list[int]) -> bool:
    """True when no live process holds save `save_id`'s lock (its marker gone, or lockable)."""
    try:
        import fcntl
    except ImportError:
        return False

    marker = os.path.join(directory, f".{stem}-{save_id}.saving")
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # the save removed it when it finished (markers exist before any shard)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    held.append(fd)  # kept until its shards are gone, so the marker is not taken over meanwhile
    return True


def _root_shards(url: str) -> set[str] | None:
    """The shard files the root at `url` names now; None when it cannot be read."""
    try:
        _, _, st_header = container.read_head(url, url)
        return {s["file"] for s in container.coatstate_header(st_header, url).get("shards") or []}
    except FileNotFoundError:
        return set()
    except Exception:  # noqa: BLE001 - an unreadable root: remove nothing
        return None


def _has_flock() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:  # (Windows): cleaned up as on a remote filesystem
        return False
    return True


def remove_orphans(url: str, own: tuple[str, list[str]] | None, previous: dict[str, Any] | None) -> None:
    """Best effort, after a commit: remove shards of `url`'s stem that no root names and no
    running save needs. `own`: this save's id and shard names (None for a single file);
    `previous`: the header of the root this commit replaced."""
    replaced = ownership.files_of_replaced(url, previous)
    fs, path = storage.url_to_fs(url)
    if not (storage.is_local(fs) and _has_flock()):
        current = _root_shards(url)
        if current is None:
            return
        candidates = dict(replaced)
        if own is not None:
            candidates.update({n: own[0] for n in own[1]})
        storage.remove_quietly(
            url, [n for n, i in candidates.items() if n not in current and ownership.owned(url, n, i)]
        )
        return
    _sweep_local(url, os.path.dirname(path) or ".", own[0] if own else None, set(replaced.values()))


def _sweep_local(url: str, directory: str, own_id: str | None, replaced_ids: set[str]) -> None:
    stem = stem_of(url)
    shard_re, marker_re, temp_re = shard_pattern(stem), _marker_pattern(stem), temp_shard_pattern(stem)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    ids: dict[str, list[str]] = {}
    markers: set[str] = set()
    temps: dict[str, list[str]] = {}
    for name in names:
        if m := shard_re.fullmatch(name):
            ids.setdefault(m.group(1), []).append(name)
        elif m := marker_re.fullmatch(name):
            markers.add(m.group(1))
        elif m := temp_re.fullmatch(name):
            temps.setdefault(m.group(1), []).append(name)
    held: list[int] = []
    try:
        # which saves are over is decided before the root is read: a save that ends after this
        # point is kept, and one that ended before has committed (or failed) already. A save whose
        # root this commit replaced is over whatever its lock says: it committed, so it is final.
        candidates = set(ids) | markers | set(temps)
        done = {own_id, *replaced_ids}
        over = {i for i in candidates if i in done or _save_is_over(directory, stem, i, held)}
        current = _root_shards(url)
        if current is None:
            return
        for save_id in over:
            for name in temps.get(save_id, ()) if save_id != own_id else ():  # a crashed shard write
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
            for name in ids.get(save_id, ()):
                if name not in current and ownership.owned(url, name, save_id):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, name))
            if save_id != own_id and not any(n in current for n in ids.get(save_id, ())):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, f".{stem}-{save_id}.saving"))
    finally:
        for fd in held:
            os.close(fd)


# ---------------------------------------------------------------------------------- writing
def plan_shards(stored: dict, shard_size: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for key, t in stored.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    return shards + [current] if current else shards


def write(url: str, stored: dict, header: dict, shard_size: int | None, metadata) -> dict[str, Any] | None:
    """Write the checkpoint (shards first when it exceeds `shard_size`), commit the root, clean up.

    `metadata(header)` makes the root's safetensors metadata once the shard index is in `header`.
    Returns the header of the root this save replaced (None if there was none, or unreadable).
    """
    total = sum(t.numel() * t.element_size() for t in stored.values())
    if shard_size is None or total <= shard_size:
        previous = ownership.current_root(url)
        storage.atomic_write(url, lambda f: container.write_safetensors(f, stored, metadata(header)), total)
        remove_orphans(url, None, previous)
        return previous
    stem, save_id = stem_of(url), uuid.uuid4().hex[:8]
    lock = _SaveLock(url, save_id)
    written: list[str] = []
    committed = False
    try:
        plan = plan_shards(stored, shard_size)
        shards = []
        for i, keys in enumerate(plan, 1):
            name = shard_name(stem, save_id, i, len(plan))
            part = {k: stored[k] for k in keys}
            meta = {"format": "pt", SHARD_KEY: json.dumps({"save_id": save_id, "index": i, "of": len(plan)})}
            box: dict[str, Any] = {}

            def write_shard(f, part=part, meta=meta, box=box):
                hashing = _Hashing(f)
                box["bytes"] = container.write_safetensors(hashing, part, meta)
                box["sha256"] = hashing.h.hexdigest()

            written.append(name)
            storage.atomic_write(
                storage.sibling_url(url, name),
                write_shard,
                sum(t.numel() * t.element_size() for t in part.values()),
            )
            shards.append({"file": name, "sha256": box["sha256"], "bytes": box["bytes"], "tensors": keys})
        header["shards"] = shards
        meta = metadata(header)
        previous = ownership.current_root(url)  # read last: the root this commit really replaces
        storage.atomic_write(url, lambda f: container.write_safetensors(f, {}, meta))  # the commit point
        committed = True
    finally:
        if not committed:
            storage.remove_quietly(url, written)  # a save that failed before its commit
        # released before the cleanup, never after: a committed save writes nothing more, and a
        # concurrent save that commits while this one cleans up must see it over (module docstring)
        lock.release()
    remove_orphans(url, (save_id, written), previous)
    return previous


# ---------------------------------------------------------------------------------- reading
def read(url: str, header: dict, verify: bool) -> dict:
    """All tensors of the shards the root's `header` names; ShardMissing when one is gone."""
    stored = {}
    for shard in header["shards"]:
        shard_url = storage.sibling_inside(url, shard["file"], "shard")
        try:
            data = storage.read_bytes(shard_url)
        except FileNotFoundError:
            raise ShardMissing(f"{url}: shard {shard['file']} is missing") from None
        if len(data) != shard["bytes"] or (verify and hashlib.sha256(data).hexdigest() != shard["sha256"]):
            raise CheckpointError(f"{url}: checksum mismatch for shard {shard['file']}: the file is corrupt")
        part = container.load_tensors(data, shard_url)
        if sorted(part) != sorted(shard["tensors"]):
            raise CheckpointError(f"{url}: shard {shard['file']} does not hold the tensors its index lists")
        stored.update(part)
    return stored
