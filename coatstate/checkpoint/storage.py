"""Files under coatstate checkpoints: fsspec URLs, whole-object reads, atomic writes."""

from __future__ import annotations

import contextlib
import io
import os
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import fsspec

TEST_PAUSE_ENV = "COATSTATE_TEST_PAUSE_MID_WRITE"
"""Test-only hook: when set to a path, every write pauses for 60 s after writing half of the
temporary file, after creating that path (so a test can SIGKILL the writer at a known point)."""


def url_to_fs(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(f"url must be a str path or fsspec URL; got {type(url).__name__}")
    try:
        return fsspec.core.url_to_fs(os.fspath(url))
    except (ImportError, ValueError) as e:
        raise ValueError(f"cannot open {url!s}: {e} (s3:// needs `pip install s3fs`)") from e


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def sibling(fs: fsspec.AbstractFileSystem, path: str, name: str) -> str:
    """The path of file `name` in the directory of `path` on `fs`."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if is_local(fs):
        return os.path.join(os.path.dirname(path), name)
    return f"{parent}/{name}" if parent else name


def sibling_url(url: str, name: str) -> str:
    """The URL of file `name` in the directory of `url` (same scheme and filesystem)."""
    return url[: len(url) - len(os.path.basename(url))] + name


def read_bytes(url: str, *, length: int | None = None) -> bytes:
    """The whole object (or its first `length` bytes)."""
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            return f.read() if length is None else f.read(length)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {url}") from None


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


def atomic_write(url: str, write: Callable[[BinaryIO], Any], total_hint: int = 0) -> None:
    """Write `url` so that readers see the old object or the complete new one, never a mix.

    Local: temp file in the same directory, fsync, os.replace, fsync of the directory (POSIX
    rename is atomic). Other filesystems: write `<name>.tmp-<uuid>`, then fs.mv onto the final
    name: atomic on memory://; on object stores (s3, gcs) each object PUT/copy is atomic, so the
    final key never holds a partial object. A crash leaves at most a stray temp object.
    """
    fs, path = url_to_fs(url)
    tmp_name = f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}"
    tmp = sibling(fs, path, tmp_name)
    hooked = (lambda f: _HalfwayHook(f, total_hint)) if os.environ.get(TEST_PAUSE_ENV) else (lambda f: f)
    if is_local(fs):
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cannot save to {url}: directory {directory} does not exist")
        try:
            with open(tmp, "wb") as f:
                write(hooked(f))
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
        return
    try:
        with fs.open(tmp, "wb") as f:
            write(hooked(f))
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise


def remove_quietly(url: str, names: Iterable[str]) -> None:
    """Best-effort removal of files next to `url` (old shards)."""
    fs, path = url_to_fs(url)
    for name in names:
        with contextlib.suppress(Exception):
            fs.rm(sibling(fs, path, name))
