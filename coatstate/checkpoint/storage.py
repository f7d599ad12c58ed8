"""Files under coatstate checkpoints: fsspec URLs, whole-object reads, atomic writes."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import fsspec

from coatstate.formats.schema import CheckpointError

TEST_PAUSE_ENV = "COATSTATE_TEST_PAUSE_MID_WRITE"
"""Test-only hook: when set to a path, every write pauses for 60 s after writing half of the
temporary file, after creating that path (so a test can SIGKILL the writer at a known point)."""


NAME_MAX = 255
"""Bytes in one file name on Linux, macOS and Windows file systems."""


class Location(str):
    """A URL resolved once: the URL as given (a str, so messages and file names are made from it
    as before) that carries its fsspec filesystem and path. The API resolves each URL it is
    given into one, and every function below takes it (or a plain URL, resolved on the spot), so
    a save does not parse its URL again at every hop (as DCP's FileSystemWriter keeps its fs)."""

    fs: fsspec.AbstractFileSystem
    path: str

    def __new__(cls, url: str, fs: fsspec.AbstractFileSystem, path: str) -> Location:
        self = super().__new__(cls, url)
        self.fs, self.path = fs, path
        return self

    def sibling(self, name: str) -> Location:
        """File `name` in the same directory, on the same filesystem."""
        return Location(
            self[: len(self) - len(os.path.basename(self))] + name, self.fs, sibling(self.fs, self.path, name)
        )


def locate(url: str | os.PathLike | Location) -> Location:
    """`url` resolved into a Location (a Location is returned as it is)."""
    if isinstance(url, Location):
        return url
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(f"url must be a str path or fsspec URL; got {type(url).__name__}")
    try:
        fs, path = fsspec.core.url_to_fs(os.fspath(url))
    except (ImportError, ValueError) as e:
        raise ValueError(f"cannot open {url!s}: {e} (s3:// needs `pip install s3fs`)") from e
    return Location(os.fspath(url), fs, path)


def url_to_fs(url: str | os.PathLike | Location) -> tuple[fsspec.AbstractFileSystem, str]:
    location = locate(url)
    return location.fs, location.path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def sibling(fs: fsspec.AbstractFileSystem, path: str, name: str) -> str:
    """The path of file `name` in the directory of `path` on `fs`."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if is_local(fs):
        return os.path.join(os.path.dirname(path), name)
    return f"{parent}/{name}" if parent else name


def sibling_url(url: str | Location, name: str) -> Location:
    """File `name` in the directory of `url` (same scheme and filesystem)."""
    return locate(url).sibling(name)


def sibling_inside(root: str | Location, name: str, what: str) -> Location:
    """Where file `name` next to `root` (a shard, a rank file) is read from: a local one by its
    real path, which must be in the root's directory (a symlink out of it is refused before
    anything is opened); other filesystems have no symlinks, so their sibling URL."""
    root = locate(root)
    url = root.sibling(name)
    if not is_local(url.fs):
        return url
    real = os.path.realpath(url.path)
    directory = os.path.realpath(os.path.dirname(os.path.abspath(root.path)))
    if os.path.dirname(real) != directory:
        raise CheckpointError(f"{root}: {what} {name} resolves to {real}, outside the checkpoint's directory")
    return Location(real, url.fs, real)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _read_local(path: str, url: str, length: int | None) -> bytes:
    # O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked on the open
    # descriptor (no race with a rename), and reads stop at the size it had then
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {url}") from None
    except OSError as e:
        raise CheckpointError(f"{url}: cannot open ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{url}: is {_kind(st.st_mode)}, not a regular file; a checkpoint is a .safetensors or "
                ".pt file (or a torch.distributed.checkpoint directory, for read/load/convert)"
            )
        want = st.st_size if length is None else min(length, st.st_size)
        chunks, got = [], 0
        while got < want:
            chunk = os.read(fd, min(want - got, 1 << 26))
            if not chunk:
                break  # the file shrank while being read: the caller sees a short read
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    except IsADirectoryError:
        raise CheckpointError(f"{url}: is a directory, not a checkpoint file") from None
    finally:
        os.close(fd)


def read_bytes(url: str, *, length: int | None = None) -> bytes:
    """The whole object (or its first `length` bytes), never more than its size.

    Local paths must be regular files: a FIFO, a device, a directory or a symlink loop raises
    CheckpointError instead of blocking or reading forever.
    """
    fs, path = url_to_fs(url)
    if is_local(fs):
        return _read_local(path, url, length)
    try:
        size = fs.size(path)
        with fs.open(path, "rb") as f:
            want = size if length is None else min(length, size)
            return f.read(want)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {url}") from None


def read_range(url: str, start: int, length: int) -> bytes:
    """`length` bytes at `start` (regular local files only, as read_bytes), bounded by the size."""
    fs, path = url_to_fs(url)
    if is_local(fs):
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{url}: is {_kind(st.st_mode)}, not a regular file")
            return os.pread(fd, max(0, min(length, st.st_size - start)), start)
        finally:
            os.close(fd)
    with fs.open(path, "rb") as f:
        f.seek(start)
        return f.read(max(0, min(length, fs.size(path) - start)))


def file_size(url: str) -> int:
    fs, path = url_to_fs(url)
    return int(fs.size(path))


def _pause_for_tests(f: BinaryIO) -> None:
    marker = os.environ.get(TEST_PAUSE_ENV)
    if marker:
        f.flush()
        with open(marker, "w") as m:
            m.write(str(os.getpid()))
        time.sleep(60)


class _HalfwayHook(io.RawIOBase):
    """Wraps a file; calls the test hook once half of `total` bytes went through."""

    def __init__(self, f: BinaryIO, total: int):
        self.f, self.total, self.seen, self.fired = f, total, 0, False

    def write(self, b) -> int:  # type: ignore[override]
        n = self.f.write(b) or len(memoryview(b))
        self.seen += n
        if not self.fired and self.seen * 2 >= self.total:
            self.fired = True
            _pause_for_tests(self.f)
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:  # (rank files rewrite their header)
        return self.f.seek(offset, whence)


def check_directory(url: str) -> None:
    """Make the directory of `url` and its parents where missing (as save_pretrained does), on
    any fsspec filesystem; raises OSError when a parent is a file or cannot be made."""
    fs, path = url_to_fs(url)
    parent = os.path.dirname(path) if is_local(fs) else (path.rsplit("/", 1)[0] if "/" in path else "")
    if not parent or (is_local(fs) and os.path.isdir(parent)):
        return
    if is_local(fs) and os.pardir in parent.split(os.sep):
        # makedirs("missing/..") makes missing/ and the save then fails (the kernel resolves ".."
        # after each directory exists, so that path names no directory that makedirs could make)
        raise FileNotFoundError(
            f"cannot save to {url}: directory {parent} does not exist (missing directories are made only "
            "for paths without '..'; make it first, or give the path without '..')"
        )
    try:
        fs.makedirs(parent, exist_ok=True)
    except FileExistsError:  # (a file where a directory should be)
        raise NotADirectoryError(f"cannot save to {url}: {parent} is not a directory") from None


def _existing_directory(path: str, url: str) -> str:
    """The directory of local `path`, which must exist (the error names `url`)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save to {url}: directory {directory} does not exist")
    return directory


def atomic_write(url: str, write: Callable[[BinaryIO], Any], total_hint: int = 0) -> None:
    """Write `url` so that readers see the old object or the complete new one, never a mix.

    Local: temp file in the same directory, fsync, os.replace, fsync of the directory (POSIX
    rename is atomic). Other filesystems: write `<name>.tmp-<uuid>`, then copy it onto the final
    name (move_literal: `url` is never a glob pattern): atomic on memory://; on object stores
    (s3, gcs) each object PUT/copy is atomic, so the final key never holds a partial object. A
    crash leaves at most a stray temp object.
    """
    fs, path = url_to_fs(url)
    tmp = sibling(fs, path, temp_name(os.path.basename(path)))
    hooked = (lambda f: _HalfwayHook(f, total_hint)) if os.environ.get(TEST_PAUSE_ENV) else (lambda f: f)
    try:
        if is_local(fs):
            _write_local(tmp, path, _existing_directory(path, url), lambda f: write(hooked(f)))
            return
        try:
            with fs.open(tmp, "wb") as f:
                write(hooked(f))
            move_literal(fs, tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(tmp)
            raise
    except OSError as e:
        if e.errno is None:  # (ours, which names the path already)
            raise
        raise _naming(url, e) from e


def _write_local(tmp: str, path: str, directory: str, write: Callable[[BinaryIO], Any]) -> None:
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """`.{name}.tmp-{random}`, with `name` cut short (at a UTF-8 character) where the whole would
    pass NAME_MAX: a legal 255-byte file name must still be savable."""
    suffix = f".tmp-{uuid.uuid4().hex[:12]}"
    room = NAME_MAX - 1 - len(suffix)
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > room:
        name = encoded[:room].decode("utf-8", "ignore")
    return f".{name}{suffix}"


def _naming(url: str, e: OSError) -> OSError:
    """`e` as an OSError of the same kind that names `url`, the user's path (the temp file it
    was written through is ours), and on a full disk what to do."""
    why = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        why += "; free space there or save elsewhere (the previous file at this path is untouched)"
    return OSError(e.errno, f"cannot write {url}: {why}")


def move_literal(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """fs.mv without its glob expansion: fsspec's mv, copy and rm read `* ? [ ]` in a path as a
    pattern, so a checkpoint named run*.safetensors would move onto nothing (or onto every match).
    cp_file and rm_file take one literal path each; mv is this copy and delete on object stores."""
    fs.cp_file(src, dst)
    fs.rm_file(src)


def sibling_sizes(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, int]:
    """{name: bytes} of the files in the directory of `path` ({} when there is no directory);
    listed afresh (s3fs caches listings, and another process may have written since)."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    fs.invalidate_cache(parent)
    try:
        entries = fs.ls(parent, detail=True)
    except FileNotFoundError:
        return {}
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
        for e in entries
        if e.get("type") == "file"
    }


def remove_quietly(url: str, names: Iterable[str]) -> None:
    """Best-effort removal of files next to `url` (old shards)."""
    fs, path = url_to_fs(url)
    for name in names:
        with contextlib.suppress(Exception):
            fs.rm_file(sibling(fs, path, name))  # (rm_file: a name is never a glob pattern)
