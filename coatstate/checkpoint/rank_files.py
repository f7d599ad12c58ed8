"""Per-rank checkpoints, one rank's side: which rows of each tensor a rank writes, and its file.

Every tensor is viewed along dim 0 (a 0-d tensor is one row). A DTensor placed with Shard(0)
and Replicate holds a contiguous range of rows on each rank; the rank whose coordinate is 0 on
every Replicate mesh dimension writes that range, so each row is written exactly once. A plain
tensor (DDP, a replicated state, `step`) is written whole by rank 0. Compressed moments need no
care: their groups never cross a row, so any row range of codes, scales and exponents is itself
a valid compressed tensor.

A rank's file is a plain safetensors file of its pieces under their global keys. Its metadata
holds the rank's manifest: per piece the rows it holds and a sha256 per block of rows
(BLOCK_BYTES), so a reader that needs a few rows reads and verifies only the blocks that hold
them. docs/CHECKPOINT.md ("Per-rank checkpoints") specifies both.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from coatstate import distributed
from coatstate.checkpoint import container, storage
from coatstate.checkpoint.layout import (  # noqa: F401 - re-exported: the names a rank file goes by
    BLOCK_BYTES,
    MANIFEST_KEY,
    block_rows,
    lock_id,
    marker_name,
    num_rows,
    rank_file_name,
    rank_file_pattern,
    row_bytes,
    stem_of,
)
from coatstate.formats import schema


# ---------------------------------------------------------------- which rows a rank holds
def dtensor_rows(t: torch.Tensor, what: str) -> tuple[int, int, bool]:
    """(first row, end row, whether this rank writes them) of DTensor `t`'s local shard.

    Shard(0) cuts rows as torch.chunk does (DTensor's rule: ceil(n / k) rows per chunk, the last
    ones shorter or empty), mesh dimension by mesh dimension; Replicate keeps them.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate()
    start, stop, writer = 0, num_rows(t.shape), True
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            writer = writer and coordinate[dim] == 0
        elif isinstance(placement, Shard) and placement.dim == 0 and t.ndim > 0:
            n, k = stop - start, mesh.size(dim)
            chunk = -(-n // k) if n else 0
            start, stop = (
                start + min(coordinate[dim] * chunk, n),
                start + min((coordinate[dim] + 1) * chunk, n),
            )
        else:
            raise ValueError(
                f"{what} is a DTensor with placements {t.placements}: a per-rank checkpoint stores "
                "dim-0 rows (Shard(0) or Replicate) only; save it with distributed='gathered' or "
                "torch.distributed.checkpoint"
            )
    local = distributed.local_tensor(t)
    if t.ndim and local.shape[0] != stop - start:
        raise ValueError(
            f"{what}: its local shard has {num_rows(local.shape)} rows, but its placements give rows "
            f"{start}:{stop} (a layout this per-rank writer does not know); use distributed='gathered'"
        )
    return start, stop, writer


def local_pieces(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """{key: (first row, this rank's rows)} of what this rank writes (no collective)."""
    out = {}
    for key, t in tensors.items():
        if distributed.is_dtensor(t):
            start, stop, writes = dtensor_rows(t, f"tensor {key!r}")
            if writes and stop > start:
                out[key] = (start, distributed.local_tensor(t).detach())
        elif rank == 0 and num_rows(t.shape) > 0:
            out[key] = (0, t.detach())
    return out


# --------------------------------------------------------------------------- the rank file
def _sha256(view: memoryview) -> str:
    return schema.checksum(view)


def piece_digest(checksums: list[str]) -> str:
    """What the root's per-tensor checksum is built from: sha256 of a piece's block checksums."""
    return hashlib.sha256("".join(checksums).encode()).hexdigest()


def tensor_digest(piece_digests: list[str]) -> str:
    """The root's `checksum` of a per-rank tensor: sha256 over its pieces' digests in row order."""
    return schema.checksum("".join(piece_digests).encode())


def _spans(t: torch.Tensor) -> tuple[int, list[tuple[int, int]]]:
    """(rows per block, byte spans of the blocks) of a contiguous CPU piece."""
    rows, step = num_rows(t.shape), block_rows(t.shape, t.element_size())
    per_row = row_bytes(t.shape, t.element_size())
    return step, [(b * per_row, min(b + step, rows) * per_row) for b in range(0, rows, step)]


def _workers(jobs: int) -> int:
    return max(1, min(jobs, os.cpu_count() or 1))


def block_checksums(pieces: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """{key: {"block_rows", "checksums"}} of CPU pieces, hashed on a thread pool (hashlib
    releases the GIL on large buffers)."""
    jobs, layout = [], {}
    for key, t in pieces.items():
        step, spans = _spans(t)
        data = schema.tensor_bytes(t)
        layout[key] = (step, len(jobs), len(spans))
        jobs += [data[a:e] for a, e in spans]
    with ThreadPoolExecutor(max_workers=_workers(len(jobs))) as pool:
        digests = list(pool.map(_sha256, jobs))
    return {k: {"block_rows": s, "checksums": digests[i : i + n]} for k, (s, i, n) in layout.items()}


_PLACEHOLDER = f"{schema.CHECKSUM_ALGORITHM}:{'0' * 64}"
"""Stands for a block checksum in the header written first (a checksum has the same length)."""


def _manifest(save_id: str, rank: int, world_size: int, pieces: dict, tensors: dict, sums: dict) -> dict:
    return {
        "save_id": save_id,
        "rank": rank,
        "world_size": world_size,
        "pieces": {
            k: {"rows": [start, start + num_rows(tensors[k].shape)], **sums[k]}
            for k, (start, _) in pieces.items()
        },
    }


def _write_hashing(f, tensors: dict, manifest_of) -> tuple[int, dict]:
    """Write a rank file into local file `f` while a thread pool hashes its blocks, then rewrite
    its header with the checksums: hashing overlaps the write instead of preceding it. The
    header's length does not change (every checksum has the placeholder's length), and the file
    becomes visible only when complete (storage.atomic_write renames it)."""
    layouts = {k: _spans(t) for k, t in tensors.items()}
    placeholder = {
        k: {"block_rows": s, "checksums": [_PLACEHOLDER] * len(sp)} for k, (s, sp) in layouts.items()
    }
    futures: dict[str, list] = {}
    with ThreadPoolExecutor(max_workers=_workers(sum(len(sp) for _, sp in layouts.values()))) as pool:

        def hash_blocks(key: str, data: memoryview) -> None:
            futures[key] = [pool.submit(_sha256, data[a:e]) for a, e in layouts[key][1]]

        meta = {"format": "pt", MANIFEST_KEY: _text(manifest_of(placeholder))}
        written = container.write_safetensors(f, tensors, meta, before_each=hash_blocks)
        sums = {
            k: {"block_rows": layouts[k][0], "checksums": [x.result() for x in futures[k]]} for k in tensors
        }
    head = container.safetensors_header(tensors, {**meta, MANIFEST_KEY: _text(manifest_of(sums))})
    if len(head) != len(container.safetensors_header(tensors, meta)):  # (would overwrite tensor bytes)
        raise schema.CheckpointError("internal error: a rank file's header changed length with its checksums")
    f.seek(0)
    f.write(head)
    f.seek(0, os.SEEK_END)
    return written, sums


def _text(manifest: dict) -> str:
    return json.dumps(manifest, separators=(",", ":"))


def write_rank_file(url: str, save_id: str, rank: int, world_size: int, pieces: dict) -> dict[str, Any]:
    """Write this rank's file next to `url` (atomically); returns its report for the root.

    `pieces`: {key: (first row, CPU tensor)}. The report holds what rank 0 needs to commit:
    the file name and size, the manifest's sha256, and per key the rows and piece digest.
    """
    name = rank_file_name(stem_of(url), save_id, rank, world_size)
    target = storage.sibling_url(url, name)
    tensors = {k: t if t.is_contiguous() else t.contiguous() for k, (_, t) in pieces.items()}

    def manifest_of(sums: dict) -> dict:
        return _manifest(save_id, rank, world_size, pieces, tensors, sums)

    box: dict[str, Any] = {}
    if storage.is_local(storage.url_to_fs(target)[0]):  # (a seekable file)

        def write(f):
            box["bytes"], box["sums"] = _write_hashing(f, tensors, manifest_of)

    else:  # object stores stream forward only: hash first
        box["sums"] = block_checksums(tensors)

        def write(f):
            meta = {"format": "pt", MANIFEST_KEY: _text(manifest_of(box["sums"]))}
            box["bytes"] = container.write_safetensors(f, tensors, meta)

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    storage.atomic_write(target, write, total)
    manifest = manifest_of(box["sums"])
    text = _text(manifest)
    return {
        "rank": rank,
        "file": name,
        "bytes": box["bytes"],
        "manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "pieces": {
            k: [p["rows"][0], p["rows"][1], piece_digest(p["checksums"])]
            for k, p in manifest["pieces"].items()
        },
    }
