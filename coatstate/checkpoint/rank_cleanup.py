"""Per-rank checkpoints: removing the files no checkpoint names any more.

After a commit (after_commit). A per-rank save never overwrites a file: its files carry a fresh
save id. After its commit, rank 0 removes the files of the root it replaced, and (on a local
filesystem) every file of its stem that the current root does not name and whose writer is gone:
each rank holds an exclusive flock on `.{stem}-{id}-rank{r}.saving` (shards._SaveLock) from
before its file until it knows the outcome of the save, and the kernel drops the lock of a killed
process, so the files of a crashed or failed save go with the next commit while those of a save
still running stay. Other fsspec filesystems (s3, memory://) have no such lock: there only the
replaced root's files and this save's own temp files and markers are removed; a killed save's
files stay, as shards do, until remove_unreferenced. Never raises: a failed removal leaves a file
that is never read.

On request (remove_unreferenced, `coatstate clean URL`), on any filesystem: every file of the
root's stem that the root does not name (rank files of other save ids, orphan shards, temp files,
markers, the root's own temp files). The caller asserts that no save to that URL is running, since
without locks nothing tells a killed save's files from those of one still writing; on a local
filesystem the files of a writer that still holds its flock are kept anyway. Without a readable
root nothing is removed (a CheckpointError says why).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

from coatstate.checkpoint import container, ownership, shards, storage
from coatstate.checkpoint.rank_files import lock_id, marker_name, rank_file_pattern, stem_of
from coatstate.formats.schema import CheckpointError

current_root = ownership.current_root
named_files = ownership.named_files


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
            shards.remove_orphans(url, None, previous)
        replaced = ownership.files_of_replaced(url, previous)  # (the one rule: name and metadata)
        fs, path = storage.url_to_fs(url)
        if storage.is_local(fs) and _has_flock():
            _sweep_local(url, os.path.dirname(path) or ".", own_id, set(replaced.values()))
            return
        root = current_root(url)
        current = named_files(root)
        stale = [n for n in replaced if n not in current]
        if own_id is not None:
            world = int(((root or {}).get("per_rank") or {}).get("world_size", 0))
            stale += [marker_name(stem_of(url), own_id, r, "done") for r in range(world)]
            stale += _own_leftovers(fs, path, own_id)
        storage.remove_quietly(url, sorted(set(stale) - current))
    except Exception:  # noqa: BLE001 - cleanup never fails a committed save
        return


def _has_flock() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


def _sweep_local(url: str, directory: str, own_id: str | None, replaced_ids: set[str]) -> None:
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
        # (and the save whose root this commit replaced committed: its files are final, whatever its locks)
        gone = {
            (save_id, rank)
            for save_id, rank in owned
            if save_id == own_id
            or save_id in replaced_ids
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
                finished = ownership.parse(name, stem) is not None  # (temps and markers have no metadata)
                if name not in current_names and (not finished or ownership.owned(url, name, save_id)):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, name))
    finally:
        for fd in held:
            os.close(fd)


def path_of(url: str) -> str:
    return storage.url_to_fs(url)[1]


def _own_leftovers(fs, path: str, own_id: str) -> list[str]:
    """Temp files and markers of the committed save `own_id` that a failed removal left (an s3
    mv is a copy plus a delete): after the commit no rank of it writes any more."""
    stem, root_name = stem_of(path), os.path.basename(path)
    patterns = _Patterns(stem, root_name)
    return [
        name
        for name in storage.sibling_sizes(fs, path)
        if (owner := patterns.owner(name)) and owner[1] == own_id and owner[0] in ("temp", "marker")
    ]


# ------------------------------------------------------- on request: remove_unreferenced
class _Patterns:
    """The names only a save of checkpoint `stem` writes next to its root `root_name`."""

    def __init__(self, stem: str, root_name: str):
        s, marker = re.escape(stem), _marker_pattern(stem).pattern
        self.rank = rank_file_pattern(stem)
        self.shard, self.shard_temp = ownership.shard_pattern(stem), ownership.temp_shard_pattern(stem)
        self.by_id = [  # (kind, pattern: group 1 the save id, group 2 the rank or None)
            ("marker", re.compile(marker)),
            ("temp", re.compile(r"\." + marker + r"\.tmp-[0-9a-f]{12}")),  # a marker's atomic write
            (
                "lock temp",
                re.compile(r"\." + s + r"-([0-9a-f]{8})(?:-rank(\d{5}))?\.saving\.tmp-[0-9a-f]{8}"),
            ),
        ]
        self.root_temp = re.compile(r"\." + re.escape(root_name) + r"\.tmp-[0-9a-f]{12}")

    def owner(self, name: str) -> tuple[str, str | None, int | None] | None:
        """(kind, save id, rank) of `name`, kind "rank" / "shard" (a finished file), "temp",
        "marker" or "lock temp" (shards._SaveLock's, before its rename); None: not a save's file
        (the root itself, another stem's file, anything else)."""
        if m := self.rank.fullmatch(name):
            if bool(m.group(1)) != bool(m.group(4)):
                return None  # a dot without a temp suffix or the reverse: no writer of ours names so
            return ("temp" if m.group(1) else "rank", m.group(2), int(m.group(3)))
        if m := self.shard.fullmatch(name):
            return ("shard", m.group(1), None)
        if m := self.shard_temp.fullmatch(name):
            return ("temp", m.group(1), None)
        for kind, pattern in self.by_id:
            if m := pattern.fullmatch(name):
                return (kind, m.group(1), None if m.group(2) is None else int(m.group(2)))
        if self.root_temp.fullmatch(name):
            return ("temp", None, None)  # the root's own, of a save killed while writing it
        return None


@dataclass
class Sweep:
    """What remove_unreferenced found next to a root: `removed` (name, bytes), removed or, in a
    dry run, to remove; `kept` (name, why) for files of the stem it leaves although no root
    names them."""

    removed: list[tuple[str, int]] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)


def remove_unreferenced(url: str | os.PathLike, *, dry_run: bool = True) -> list[str]:
    """Remove the files next to the checkpoint `url` that its root does not name; returns their URLs.

    Only files of this checkpoint's stem that a save writes are considered: rank files of other
    save ids, orphan shards of sharded saves, their temp files (`.{name}.tmp-*`), markers of
    finished or killed saves, temp files of the root; never the root, never a file it names,
    never another stem's. Rank files and shards go only if their metadata carries the save id of
    their name. `dry_run=True` (the default) removes nothing and returns what it would remove.

    Use it where a killed save left files that after-commit cleanup cannot tell from a running
    save's (s3 and other filesystems without flock). The caller asserts that no save to `url` is
    running (a running save's files would be removed, and its root would name missing files); on
    a local filesystem files whose writer still holds its flock are kept anyway.

    Raises CheckpointError when the root is missing or cannot be read, removing nothing: a
    missing root with files of its stem is a first save killed before it committed, or a root
    lost while its files stay; coatstate does not guess which (remove them by hand).
    """
    url = storage.locate(url)  # resolved once: every function below takes the Location
    return [storage.sibling_url(url, name) for name, _ in sweep(url, dry_run=dry_run).removed]


def sweep(url: str, *, dry_run: bool) -> Sweep:
    """remove_unreferenced, with the sizes of the files and the ones kept (for the CLI)."""
    url = storage.locate(url)
    fs, path = url.fs, url.path
    patterns = _Patterns(stem_of(url), os.path.basename(path))
    listing = storage.sibling_sizes(fs, path)
    found = {n: owner for n in sorted(listing) if (owner := patterns.owner(n))}
    held: list[int] = []
    try:
        # which writers live is decided before the root is read (as after_commit does): a save
        # that commits after this point keeps its files, one that ended before is in the root
        live = _live_writers(fs, path, found, held)
        named = named_files(_root_or_raise(url, found))
        result = Sweep()
        for name, (kind, save_id, rank) in found.items():
            if name in named:
                continue
            if name in live or (save_id, rank) in live or (rank is None and save_id in live):
                result.kept.append((name, "a running save holds its lock"))
            elif save_id is None and live:  # a root temp file: which save writes it is unknown
                result.kept.append((name, "a save to this checkpoint holds its lock"))
            elif kind in ("rank", "shard") and not ownership.owned(url, name, save_id):
                result.kept.append((name, f"its metadata does not name save {save_id}"))
            else:
                result.removed.append((name, listing[name]))
        result.removed.sort(key=lambda item: (found[item[0]][0] == "marker", item[0]))  # markers last
        if not dry_run:
            _remove(fs, path, url, [name for name, _ in result.removed])
        return result
    finally:
        for fd in held:
            os.close(fd)


def _live_writers(fs, path: str, found: dict[str, tuple], held: list[int]) -> set:
    """Who still writes, on a local filesystem with flock: (save id, rank) and save ids whose
    `.saving` marker is locked, and names of lock temp files that are (nothing elsewhere). The
    locks taken on markers of gone writers are appended to `held`, kept until the files are gone."""
    if not storage.is_local(fs) or not _has_flock():
        return set()
    directory, stem = os.path.dirname(path) or ".", stem_of(path)
    live: set = set()
    for name, (kind, save_id, rank) in found.items():
        if kind == "marker" and name.endswith(".saving"):
            if not shards._save_is_over(
                directory, stem, save_id if rank is None else lock_id(save_id, rank), held
            ):
                live |= {(save_id, rank), save_id}
        elif kind == "lock temp" and _locked(os.path.join(directory, name), held):
            live.add(name)
    return live


def _locked(path: str, held: list[int]) -> bool:
    """True when a live process holds an flock on `path` (a lock's file before its rename)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return True
    held.append(fd)
    return False


def _root_or_raise(url: str, found: dict[str, tuple]) -> dict[str, Any]:
    try:
        _, _, st_header = container.read_head(url, url)
        return container.coatstate_header(st_header, url)
    except FileNotFoundError:
        strays = (
            f"; {len(found)} files of its stem are there, of a first save killed before its commit or "
            "of a root that was lost: coatstate does not guess which (remove them by hand if no save "
            "is running)"
        )
        raise CheckpointError(
            f"{url}: no checkpoint there, so nothing is removed{strays if found else ''}"
        ) from None
    except Exception as e:  # noqa: BLE001 - any root it cannot read: remove nothing
        raise CheckpointError(f"{url}: cannot read the root, so nothing is removed ({e})") from None


def _remove(fs, path: str, url: str, names: list[str]) -> None:
    failed = []
    for name in names:
        try:
            fs.rm(storage.sibling(fs, path, name))
        except FileNotFoundError:
            continue  # gone already
        except Exception as e:  # noqa: BLE001 - reported below, after the others were tried
            failed.append(f"{name} ({type(e).__name__}: {e})")
    if failed:
        raise OSError(f"{url}: could not remove {len(failed)} of {len(names)} files: {'; '.join(failed[:3])}")
