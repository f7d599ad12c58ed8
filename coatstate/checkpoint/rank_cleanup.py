"""Per-rank checkpoints: removing the files no checkpoint names any more, after a commit.

A per-rank save never overwrites a file: its files carry a fresh save id. After its commit,
rank 0 removes the files of the root it replaced, and (on a local filesystem) every file of
its stem that the current root does not name and whose writer is gone: each rank holds an
exclusive flock on `.{stem}-{id}-rank{r}.saving` (shards._SaveLock) from before its file until
it knows the outcome of the save, and the kernel drops the lock of a killed process, so the
files of a crashed or failed save go with the next commit while those of a save still running
stay. Other fsspec filesystems have no such lock: there only the replaced root's files and this
save's markers are removed (a killed save's files stay, as shards do). Never raises: a failed
removal leaves a file that is never read.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from coatstate.checkpoint import container, shards, storage
from coatstate.checkpoint.rank_files import lock_id, marker_name, rank_file_pattern, stem_of


def current_root(url: str) -> dict[str, Any] | None:
    """The header of the root at `url` now (None when there is none or it cannot be read)."""
    try:
        _, _, st_header = container.read_head(url, url)
        return container.coatstate_header(st_header, url)
    except Exception:  # noqa: BLE001 - nothing (readable) to replace
        return None


def named_files(header: dict[str, Any] | None) -> set[str]:
    """Every file a root names: its rank files or its shards."""
    if not header:
        return set()
    return rank_files_of(header) | {s["file"] for s in header.get("shards") or []}


def rank_files_of(header: dict[str, Any] | None) -> set[str]:
    return {f["file"] for f in ((header or {}).get("per_rank") or {}).get("files", [])}


def _marker_pattern(stem: str) -> re.Pattern:
    """Markers of per-rank saves (group 1: save id, group 2: rank or None, group 3: kind)."""
    return re.compile(r"\." + re.escape(stem) + r"-([0-9a-f]{8})(?:-rank(\d{5}))?\.(done|failed|saving)")


def after_commit(url: str, own_id: str | None, previous: dict[str, Any] | None) -> None:
    """Best effort, after the root at `url` was replaced (`previous`: the header it replaced).

    `own_id`: the per-rank save that committed (None for a single-file or sharded save).
    """
    try:
        if previous and previous.get("shards"):
            shards.remove_orphans(url, None, sorted(named_files(previous)))
        fs, path = storage.url_to_fs(url)
        if storage.is_local(fs) and _has_flock():
            _sweep_local(url, os.path.dirname(path) or ".", own_id)
            return
        root = current_root(url)
        current = named_files(root)
        stale = [n for n in rank_files_of(previous) if n not in current]
        if own_id is not None:
            world = int(((root or {}).get("per_rank") or {}).get("world_size", 0))
            stale += [marker_name(stem_of(url), own_id, r, "done") for r in range(world)]
        storage.remove_quietly(url, stale)
    except Exception:  # noqa: BLE001 - cleanup never fails a committed save
        return


def _has_flock() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


def _sweep_local(url: str, directory: str, own_id: str | None) -> None:
    """Remove rank files, their temp files and markers of saves whose writers are all gone."""
    stem = stem_of(url)
    files, markers = rank_file_pattern(stem), _marker_pattern(stem)
    owned: dict[tuple[str, int | None], list[str]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if m := files.fullmatch(name):
            owned.setdefault((m.group(2), int(m.group(3))), []).append(name)
        elif (m := markers.fullmatch(name)) and not (m.group(1) == own_id and m.group(3) == "saving"):
            owned.setdefault((m.group(1), None if m.group(2) is None else int(m.group(2))), []).append(name)
    held: list[int] = []
    try:
        # which writers are gone is decided before the root is read (as shards.py does): a save
        # that ends after this point keeps its files, one that ended before has committed or failed
        # (a marker of no rank is a sharded save's lock or a per-rank save's failed-marker: its
        # lock, when it has one, is looked at too, or a running sharded save would lose its marker)
        gone = {
            (save_id, rank)
            for save_id, rank in owned
            if save_id == own_id
            or shards._save_is_over(
                directory, stem, save_id if rank is None else lock_id(save_id, rank), held
            )
        }
        running = {save_id for save_id, rank in owned if (save_id, rank) not in gone}
        current = current_root(url)
        if current is None and os.path.exists(path_of(url)):
            return  # an unreadable root: remove nothing
        current_names = named_files(current)
        for (save_id, rank), of_writer in owned.items():
            if (save_id, rank) not in gone or (rank is None and save_id in running):
                continue
            for name in of_writer:
                if name not in current_names:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, name))
    finally:
        for fd in held:
            os.close(fd)


def path_of(url: str) -> str:
    return storage.url_to_fs(url)[1]
