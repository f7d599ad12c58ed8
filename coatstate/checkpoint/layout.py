"""Where a save puts things: the names of the files it writes next to its root, their metadata
keys, and the rows along dim 0 that per-rank saves cut tensors into (docs/CHECKPOINT.md).

The lowest module of the checkpoint package: it imports none of the others, so the header checks
(validate.py), the writers and the cleanups all name files the same way.
"""

from __future__ import annotations

import math
import os
import re

SHARD_KEY = "coatstate.shard"
"""safetensors metadata key of a shard: {"save_id", "index", "of"}."""
MANIFEST_KEY = "coatstate.rank"
"""safetensors metadata key of a rank file's manifest (JSON)."""
BLOCK_BYTES = 4 * 2**20
"""Rows are checksummed in blocks of about this size: a partial read over-reads at most two."""


def stem_of(url: str) -> str:
    """The checkpoint's name without .safetensors: every file of its saves starts with it."""
    return os.path.basename(url.rstrip("/")).removesuffix(".safetensors")


def shard_name(stem: str, save_id: str, i: int, n: int) -> str:
    return f"{stem}-{save_id}-{i:05d}-of-{n:05d}.safetensors"


def rank_file_name(stem: str, save_id: str, rank: int, world_size: int) -> str:
    return f"{stem}-{save_id}-rank{rank:05d}-of-{world_size:05d}.safetensors"


def rank_file_pattern(stem: str) -> re.Pattern:
    """Rank files of `stem` and their temp files: group 1 the temp file's leading dot, group 2
    the save id, group 3 the rank, group 4 the temp suffix."""
    return re.compile(
        r"(\.)?" + re.escape(stem) + r"-([0-9a-f]{8})-rank(\d{5})-of-\d{5}\.safetensors(\.tmp-[0-9a-f]{12})?"
    )


def marker_name(stem: str, save_id: str, rank: int | None, kind: str) -> str:
    """`.{stem}-{id}-rank{r}.{kind}` (kind: "done", "failed", "saving"); rank None: the whole save."""
    who = "" if rank is None else f"-rank{rank:05d}"
    return f".{stem}-{save_id}{who}.{kind}"


def lock_id(save_id: str, rank: int) -> str:
    """The id under which a rank holds its save lock (shards._SaveLock names the marker with it)."""
    return f"{save_id}-rank{rank:05d}"


def num_rows(shape) -> int:
    return int(shape[0]) if len(shape) else 1


def row_bytes(shape, itemsize: int) -> int:
    return math.prod(shape[1:]) * itemsize if len(shape) else itemsize


def block_rows(shape, itemsize: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes(shape, itemsize)))


def shard_pattern(stem: str) -> re.Pattern:
    """A finished shard of `stem` (group 1: its save id)."""
    return re.compile(re.escape(stem) + r"-([0-9a-f]{8})-\d{5}-of-\d{5}\.safetensors")


def temp_shard_pattern(stem: str) -> re.Pattern:
    """The temporary file of a shard being written (storage.atomic_write's name for it)."""
    return re.compile(
        r"\." + re.escape(stem) + r"-([0-9a-f]{8})-\d{5}-of-\d{5}\.safetensors\.tmp-[0-9a-f]{12}"
    )
