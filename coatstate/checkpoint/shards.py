"""Sharded checkpoints: writing shards and the root (the commit point), reading them.

When the stored tensors exceed `shard_size` they go to `{stem}-{save_id}-{i:05d}-of-{n:05d}.safetensors`
next to the root, and the root, written last, lists them. The save id is new for every save, so a
save never overwrites a shard that a root names. After its commit a save removes the shards of the
root it replaced, and only those: each must carry that root's save id in its name and in its own
metadata. Nothing is ever found by a name pattern in the directory, so a root renamed away keeps
its shards (no root is replaced at the old name), and another checkpoint's files, temp files
included, are never touched. What a save killed before its commit wrote stays (docs/CHECKPOINT.md
says how to find it). Readers that find a shard gone re-read the root (a newer commit removed it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from typing import Any, BinaryIO

from coatstate.checkpoint import container, storage
from coatstate.formats.schema import CheckpointError

__all__ = ["SHARD_KEY", "ShardMissing", "read", "write"]

SHARD_KEY = "coatstate.shard"
"""safetensors metadata key of a shard: {"save_id", "index", "of"}."""


class ShardMissing(CheckpointError):
    """A shard the root names is not there (a newer save may have replaced the root)."""


class _Hashing:
    def __init__(self, f: BinaryIO):
        self.f, self.h = f, hashlib.sha256()

    def write(self, b) -> int:
        self.h.update(b)
        return self.f.write(b)


def _stem(url: str) -> str:
    return os.path.basename(url.rstrip("/")).removesuffix(".safetensors")


def _current_root(url: str) -> dict[str, Any] | None:
    """The header of the root at `url` now (None when there is none or it cannot be read)."""
    try:
        _, _, st_header = container.read_head(url, url)
        return container.coatstate_header(st_header, url)
    except Exception:  # noqa: BLE001 - nothing (readable) to replace
        return None


def _owned_shards(url: str, previous: dict[str, Any] | None) -> list[str]:
    """The shards root `previous` (replaced at `url`) names that its own save wrote: one save id
    in every name (a save of this stem's) and in every shard's metadata."""
    names = [s["file"] for s in (previous or {}).get("shards") or []]
    pattern = re.compile(re.escape(_stem(url)) + r"-([0-9a-f]{8})-\d{5}-of-\d{5}\.safetensors")
    ids = {m.group(1) if (m := pattern.fullmatch(n)) else None for n in names}
    if len(ids) != 1 or None in ids:
        return []
    (save_id,) = ids
    owned = []
    for name in names:
        try:
            _, _, st_header = container.read_head(storage.sibling_url(url, name), name)
            if json.loads(st_header["__metadata__"][SHARD_KEY])["save_id"] == save_id:
                owned.append(name)
        except Exception:  # noqa: BLE001 - not provably of that save: left alone
            pass
    return owned


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


def write(url: str, stored: dict, header: dict, shard_size: int | None, metadata) -> None:
    """Write the checkpoint (shards first when it exceeds `shard_size`), commit the root, then
    remove the shards of the root it replaced. `metadata(header)` makes the root's safetensors
    metadata once the shard index is in `header`."""
    total = sum(t.numel() * t.element_size() for t in stored.values())
    if shard_size is None or total <= shard_size:
        previous = _current_root(url)
        storage.atomic_write(url, lambda f: container.write_safetensors(f, stored, metadata(header)))
        storage.remove_quietly(url, _owned_shards(url, previous))
        return
    stem, save_id = _stem(url), uuid.uuid4().hex[:8]
    written: list[str] = []
    committed = False
    try:
        plan = plan_shards(stored, shard_size)
        shards = []
        for i, keys in enumerate(plan, 1):
            name = f"{stem}-{save_id}-{i:05d}-of-{len(plan):05d}.safetensors"
            part = {k: stored[k] for k in keys}
            meta = {"format": "pt", SHARD_KEY: json.dumps({"save_id": save_id, "index": i, "of": len(plan)})}
            box: dict[str, Any] = {}

            def write_shard(f, part=part, meta=meta, box=box):
                hashing = _Hashing(f)
                box["bytes"] = container.write_safetensors(hashing, part, meta)
                box["sha256"] = hashing.h.hexdigest()

            written.append(name)
            storage.atomic_write(storage.sibling_url(url, name), write_shard)
            shards.append({"file": name, "sha256": box["sha256"], "bytes": box["bytes"], "tensors": keys})
        header["shards"] = shards
        meta = metadata(header)
        previous = _current_root(url)  # read last: the root this commit really replaces
        storage.atomic_write(url, lambda f: container.write_safetensors(f, {}, meta))  # the commit point
        committed = True
    finally:
        if not committed:
            storage.remove_quietly(url, written)  # a save that failed before its commit
    storage.remove_quietly(url, [n for n in _owned_shards(url, previous) if n not in written])


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
