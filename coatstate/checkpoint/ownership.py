"""Which files next to a root a save may remove: the one rule every cleanup follows.

A file belongs to save `save_id` of checkpoint `stem` when its name is one that a save of that stem
writes with that id (a shard `{stem}-{id}-{i:05d}-of-{n:05d}.safetensors`, a rank file
`{stem}-{id}-rank{r:05d}-of-{n:05d}.safetensors`) and its own safetensors metadata (the shard's
entry, the rank file's manifest) names the same id. A root's list of file names is never enough on
its own: a root copied alone to another name, or crafted, names files of another checkpoint. The
rule is the same on every filesystem; only how a cleaner learns that a save is over differs
(shards.py, rank_cleanup.py).
"""

from __future__ import annotations

import json
from typing import Any

from coatstate.checkpoint import container, storage
from coatstate.checkpoint.layout import (  # noqa: F401 - SHARD_KEY and the patterns: re-exported
    MANIFEST_KEY,
    SHARD_KEY,
    rank_file_pattern,
    shard_pattern,
    stem_of,
    temp_shard_pattern,
)


def parse(name: str, stem: str) -> tuple[str, str] | None:
    """("shard" or "rank", save id) of a finished file a save of `stem` writes; None otherwise."""
    if m := shard_pattern(stem).fullmatch(name):
        return "shard", m.group(1)
    m = rank_file_pattern(stem).fullmatch(name)
    if m and not m.group(1) and not m.group(4):  # (not a temp file)
        return "rank", m.group(2)
    return None


def written_by(file_url: str, kind: str, save_id: str) -> bool:
    """Whether the file's own metadata says save `save_id` wrote it (False when unreadable)."""
    try:
        _, _, st_header = container.read_head(file_url, file_url)
        key = MANIFEST_KEY if kind == "rank" else SHARD_KEY
        return json.loads(st_header["__metadata__"][key])["save_id"] == save_id
    except Exception:  # noqa: BLE001 - not provably of that save: left alone
        return False


def owned(root_url: str, name: str, save_id: str | None) -> bool:
    """Whether file `name` next to `root_url` belongs to save `save_id` of the root's stem."""
    parsed = parse(name, stem_of(root_url))
    return (
        save_id is not None
        and parsed is not None
        and parsed[1] == save_id
        and written_by(storage.sibling_url(root_url, name), parsed[0], save_id)
    )


def current_root(url: str) -> dict[str, Any] | None:
    """The header of the root at `url` now (None when there is none or it cannot be read)."""
    try:
        _, _, st_header = container.read_head(url, url)
        return container.coatstate_header(st_header, url)
    except Exception:  # noqa: BLE001 - nothing (readable) to replace
        return None


def save_id_of(url: str, header: dict[str, Any] | None) -> str | None:
    """The save id of root `header` at `url`: its per-rank index's, or the one id in all its shard
    names; None for a single file, or a root whose files are not all of one save of its stem."""
    if not header:
        return None
    per_rank = header.get("per_rank")
    if per_rank:
        return per_rank.get("save_id")
    ids = {parse(s["file"], stem_of(url)) for s in header.get("shards") or []}
    if len(ids) != 1 or None in ids:
        return None
    ((kind, save_id),) = ids
    return save_id if kind == "shard" else None


def named_files(header: dict[str, Any] | None) -> set[str]:
    """Every file a root names: its rank files or its shards."""
    if not header:
        return set()
    ranks = {f["file"] for f in (header.get("per_rank") or {}).get("files", [])}
    return ranks | {s["file"] for s in header.get("shards") or []}


def files_of_replaced(url: str, previous: dict[str, Any] | None) -> dict[str, str]:
    """{name: save id} of the files root `previous` (replaced at `url`) names that its save owns."""
    save_id = save_id_of(url, previous)
    return {n: save_id for n in named_files(previous) if owned(url, n, save_id)}
