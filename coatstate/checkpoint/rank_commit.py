"""Per-rank checkpoints, the commit: every rank writes its file, then rank 0 writes the root.

The root is an ordinary coatstate header (global dtypes and shapes of every tensor) with a
`per_rank` index: the rank files, and for each tensor which rows live in which file. Rank 0
writes it once every rank has reported its file (name, size, manifest sha256, rows and piece
digests); the atomic replace of the root is the commit point, so a crash at any moment leaves
the previous root and the files it names. Files of earlier saves go only after a commit
(rank_cleanup).

How the reports reach rank 0:
- blocking save: one all_gather_object, then a broadcast of the outcome, on the caller's thread;
- background save (blocking=False): no collective at all off the caller's thread, where it
  could interleave with the training loop's. Each rank's thread writes its file and then a small
  done-marker holding its report next to the root; rank 0's thread waits for every marker and
  commits; the other ranks' threads wait until the root names their save. A rank that fails
  writes a failed-marker instead, and rank 0 then marks the whole save failed, so no one waits
  out COMMIT_TIMEOUT_S for a save that cannot commit.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from coatstate import distributed
from coatstate.checkpoint import background, container, rank_cleanup, rank_files, shards, storage
from coatstate.checkpoint.rank_files import lock_id, marker_name, num_rows, stem_of
from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError

COMMIT_TIMEOUT_S = 1800.0
"""How long a background save waits for the other ranks (as long as torch's collectives do)."""
POLL_S = (0.01, 0.5)
"""First and longest pause between two looks for markers (doubling in between)."""


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---------------------------------------------------------------------------------- the root
def root_header(header: dict[str, Any], reports: list[dict | None], save_id: str, world_size: int) -> dict:
    """`header` (global tensors, no checksums) completed with the per-rank index of `reports`."""
    files, pieces = [], {}
    for report in reports:
        if report is None:  # a rank with no rows to write wrote no file
            continue
        index = len(files)
        files.append({k: report[k] for k in ("file", "rank", "bytes", "manifest_sha256")})
        for key, (start, stop, digest) in report["pieces"].items():
            pieces.setdefault(key, []).append((start, stop, index, digest))
    splits: dict[tuple, int] = {}
    tensor_splits = {}
    for key, info in header["tensors"].items():
        parts = sorted(pieces.pop(key, []))
        end, tiled = 0, True
        for start, stop, _, _ in parts:
            tiled, end = tiled and start == end, stop
        if not tiled or end != num_rows(info["shape"]):
            raise CheckpointError(
                f"tensor {key!r}: the ranks wrote rows {[(s, e) for s, e, _, _ in parts]} of its "
                f"{num_rows(info['shape'])} (do all ranks hold the same parameters and placements?)"
            )
        info["checksum"] = rank_files.tensor_digest([d for *_, d in parts])
        split = tuple((f, s, e) for s, e, f, _ in parts)
        tensor_splits[key] = splits.setdefault(split, len(splits))
    if pieces:
        raise CheckpointError(f"ranks wrote tensors {sorted(pieces)[:3]} that the header does not list")
    header["format_version"] = schema.PER_RANK_FORMAT_VERSION
    header["per_rank"] = {
        "save_id": save_id,
        "world_size": world_size,
        "files": files,
        "splits": [[list(p) for p in split] for split in splits],  # in order of first use
        "tensor_splits": tensor_splits,
    }
    return header


def _commit(
    url: str, header: dict, reports: list, save_id: str, world_size: int, metadata: Callable
) -> Callable[[], None]:
    """Rank 0: write the root (the commit point); returns the cleanup to start once this rank's
    lock is released (as shards.write does: a concurrent commit must then see this save over)."""
    meta = metadata(root_header(header, reports, save_id, world_size))
    previous = rank_cleanup.current_root(url)  # read last: the root this commit really replaces
    storage.atomic_write(url, lambda f: container.write_safetensors(f, {}, meta))
    return lambda: background.after(lambda: rank_cleanup.after_commit(url, save_id, previous))


# ------------------------------------------------------------------------------ entry point
def save(
    url: str, tensors: dict, header: dict, metadata: Callable, blocking: bool
) -> background.SaveHandle | None:
    """Write a per-rank checkpoint of `tensors` (global keys -> tensors or DTensors) at `url`.

    A collective when a process group is initialized: every rank calls it, in the same order
    as its other collectives. `header`: the checkpoint header without checksums (global shapes).
    """
    rank, world_size = _world()
    pieces, save_id, url = _start(url, tensors, rank, world_size)
    if blocking:
        pieces, ready = _snapshot(pieces, clone_cpu=False)
        if ready is not None:
            ready.synchronize()
        _save_blocking(url, pieces, header, metadata, save_id, rank, world_size)
        return None
    pieces, ready = _snapshot(pieces)

    def work() -> None:
        _save_in_background(url, pieces, header, metadata, save_id, rank, world_size)

    return background.start(url, work, ready)


def _start(url: str, tensors: dict, rank: int, world_size: int) -> tuple[dict, str, storage.Location]:
    """(this rank's pieces, the save id, `url` resolved) once every rank can start. The local
    checks (the URL, the directory, placements it cannot store) run before any I/O; then one
    collective tells every rank whether all passed, since a rank that raised alone would leave
    the others waiting in the save's next collective, and carries rank 0's fresh save id."""
    pieces, error = {}, None
    try:
        url = storage.locate(url)  # resolved once: every function below takes the Location
        storage.check_directory(url)
        pieces = rank_files.local_pieces(tensors, rank)
    except Exception as e:  # noqa: BLE001 - told to every rank below, then raised here
        error = e
    mine = (None if error is None else f"{type(error).__name__}: {error}", uuid.uuid4().hex[:8])
    gathered: list[Any] = [mine]
    if world_size > 1:
        import torch.distributed as dist

        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
    if error is not None:
        raise error
    failed = [f"rank {r}: {problem}" for r, (problem, _) in enumerate(gathered) if problem]
    if failed:
        raise CheckpointError(f"{url}: the per-rank save cannot start ({'; '.join(failed)})")
    return pieces, gathered[0][1], url


_pinned: dict[str, torch.Tensor] = {}
"""Host buffers of the last per-rank save's CUDA pieces, reused by the next one (blocking or
not): pinning gigabytes (cudaHostAlloc) takes longer than copying them, and a fresh pageable
copy pays a page fault per 4 KiB. Free once the previous save is done, which save() has waited
for before it snapshots."""


def _snapshot(pieces: dict, clone_cpu: bool = True) -> tuple[dict, Any]:
    """This rank's pieces on the CPU: CUDA pieces copied into (reused) pinned host memory, queued
    on the current stream (the event returned marks their end); CPU pieces cloned, so that the
    training loop may change them at once, unless not `clone_cpu` (a blocking save)."""
    on_gpu = {k for k, (_, t) in pieces.items() if t.is_cuda}
    if not on_gpu:
        if not clone_cpu:
            return {k: (start, t.detach()) for k, (start, t) in pieces.items()}, None
        return background.snapshot(pieces)
    out = {}
    for key, (start, t) in pieces.items():
        if key not in on_gpu:
            out[key] = (start, t.detach().clone() if clone_cpu else t.detach())
            continue
        buf = _pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = _pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out[key] = (start, buf.copy_(t.detach(), non_blocking=True))
    for key in set(_pinned) - on_gpu:  # tensors gone since the last save
        del _pinned[key]
    event = torch.cuda.Event()
    event.record()
    return out, event


def _save_blocking(url, pieces, header, metadata, save_id: str, rank: int, world_size: int) -> None:
    import torch.distributed as dist

    report, error, outcome, lock, cleanup = None, None, None, None, None
    try:
        try:
            lock = shards._SaveLock(url, lock_id(save_id, rank))  # (in here: a failure is told to all)
            if pieces:
                report = rank_files.write_rank_file(url, save_id, rank, world_size, pieces)
        except Exception as e:  # noqa: BLE001 - told to every rank below, then raised here
            error = e
        mine = {"report": report, "error": None if error is None else f"{type(error).__name__}: {error}"}
        if world_size > 1:
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if rank == 0:
            failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
            outcome = "; ".join(failed) or None
            if outcome is None:
                try:
                    reports = [g["report"] for g in gathered]
                    cleanup = _commit(url, header, reports, save_id, world_size, metadata)
                except Exception as e:  # noqa: BLE001 - told to every rank below
                    outcome = f"rank 0 could not commit the root: {type(e).__name__}: {e}"
        outcome = distributed.broadcast_from_main(outcome)
    finally:
        if lock is not None:
            lock.release()
    if cleanup is not None:
        cleanup()
    if outcome is not None and report is not None:  # certainly not committed: this save's file goes
        storage.remove_quietly(url, [report["file"]])
    if error is not None:
        raise error
    if outcome is not None:
        raise CheckpointError(f"{url}: the per-rank save failed ({outcome})")


# ----------------------------------------------------------------- background: file rendezvous
def _marker_url(url: str, save_id: str, rank: int | None, kind: str) -> str:
    return storage.sibling_url(url, marker_name(stem_of(url), save_id, rank, kind))


def _put(url: str, text: str) -> None:
    data = text.encode()
    storage.atomic_write(url, lambda f: f.write(data), len(data))


def _get(url: str) -> str | None:
    try:
        return storage.read_bytes(url).decode()
    except FileNotFoundError:
        return None


def _poll(look: Callable[[], Any], what: Callable[[], str], timeout: float) -> Any:
    """look() until it returns something other than None, or raise after `timeout` seconds."""
    deadline, pause = time.monotonic() + timeout, POLL_S[0]
    while (found := look()) is None:
        if time.monotonic() > deadline:
            raise CheckpointError(f"gave up after {timeout:g} s waiting for {what()}")
        time.sleep(pause)
        pause = min(2 * pause, POLL_S[1])
    return found


def _collect(url: str, save_id: str, world_size: int) -> list[dict | None]:
    """Rank 0: every rank's report, from its done-marker; raises when a rank failed."""
    reports: dict[int, Any] = {}

    def look():
        for r in range(world_size):
            if r in reports:
                continue
            failed = _get(_marker_url(url, save_id, r, "failed"))
            if failed is not None:
                raise CheckpointError(f"{url}: rank {r} could not write its file ({failed})")
            done = _get(_marker_url(url, save_id, r, "done"))
            if done is not None:
                reports[r] = schema.loads_json(done, url, f"rank {r}'s report")["report"]
        return reports if len(reports) == world_size else None

    _poll(
        look, lambda: f"the files of ranks {sorted(set(range(world_size)) - set(reports))}", COMMIT_TIMEOUT_S
    )
    return [reports[r] for r in range(world_size)]


def _committed(url: str, save_id: str) -> bool | None:
    """True once the root names `save_id`; raises when rank 0 marked the save failed."""
    failed = _get(_marker_url(url, save_id, None, "failed"))
    if failed is not None:
        raise CheckpointError(f"{url}: the per-rank save failed ({failed})")
    try:
        _, _, st_header = container.read_head(url, url)
        named = json.loads(st_header["__metadata__"][schema.METADATA_KEY]).get("per_rank") or {}
    except (FileNotFoundError, CheckpointError, KeyError, TypeError, ValueError):
        return None  # not there yet, or being replaced
    return True if named.get("save_id") == save_id else None


def _save_in_background(url, pieces, header, metadata, save_id: str, rank: int, world_size: int) -> None:
    lock = shards._SaveLock(url, lock_id(save_id, rank))
    report, failed, cleanup = None, False, None
    try:
        try:
            if pieces:
                report = rank_files.write_rank_file(url, save_id, rank, world_size, pieces)
        except Exception as e:
            _put(_marker_url(url, save_id, rank, "failed"), f"{type(e).__name__}: {e}")
            failed = True
            raise
        _put(_marker_url(url, save_id, rank, "done"), json.dumps({"report": report}))
        if rank != 0:
            try:
                _poll(
                    lambda: _committed(url, save_id), lambda: f"rank 0 to commit {save_id}", COMMIT_TIMEOUT_S
                )
            except CheckpointError as e:
                failed = "failed (" in str(e)  # marked failed by rank 0 (a timeout may still commit)
                raise
            return
        try:
            cleanup = _commit(url, header, _collect(url, save_id, world_size), save_id, world_size, metadata)
        except BaseException as e:
            _put(_marker_url(url, save_id, None, "failed"), f"{type(e).__name__}: {e}")
            failed = True
            raise
    finally:
        lock.release()
        if failed and report is not None:
            storage.remove_quietly(url, [report["file"]])
    if cleanup is not None:
        cleanup()
