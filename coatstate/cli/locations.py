"""Where a path or URL points, and which files a checkpoint is read from: what keeps `convert`
from writing over its own input.

A location is (filesystem, absolute path): `D/optimizer.pt`, `file://D/optimizer.pt` and a
symlink to it are one location; on memory://, s3:// and other object stores the key as fsspec
gives it (no symlinks, and `a//b` is a key of its own).
"""

from __future__ import annotations

import os
from typing import Any

from coatstate.cli.common import UsageError


def resolve(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, absolute path) of url; local paths with symlinks and '..' resolved."""
    from coatstate.checkpoint import storage

    fs, path = storage.url_to_fs(url)
    if storage.is_local(fs):
        return fs, os.path.realpath(path)
    return fs, path


def _same(a: tuple[Any, str], b: tuple[Any, str]) -> bool:
    if a[0] != b[0]:
        return False
    if a[1] == b[1]:
        return True
    from coatstate.checkpoint import storage

    if not storage.is_local(a[0]):
        return False
    try:  # hard links: one file under two names
        return os.path.samefile(a[1], b[1])
    except OSError:
        return False


def _inside_existing(directory: str, path: str) -> bool:
    """Whether local `path` exists in `directory` (or below it), by its name or what a symlink names."""
    from coatstate.checkpoint import storage

    raw = os.path.abspath(storage.url_to_fs(path)[1])
    roots = {os.path.realpath(directory), os.path.abspath(directory)}
    for p in {raw, os.path.realpath(raw)}:
        if os.path.lexists(p) and any(p.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            return True
    return False


def input_files(src: str, header: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(what, url) of every file reading src reads: src itself and, for a coatstate root, each
    shard its header names."""
    from coatstate.checkpoint import storage

    files = [(f"the same file as SRC {src}", src)]
    if not isinstance(header, dict):
        return files
    shards = header.get("shards")
    for entry in shards if isinstance(shards, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("file"), str):
            files.append((f"a shard of SRC ({entry['file']})", storage.sibling_url(src, entry["file"])))
    return files


def refuse_input_as_output(src: str, dst: str, header: dict[str, Any] | None) -> None:
    """A UsageError when writing dst would replace src or a file src is read from (header: src's
    coatstate header, or None for a .pt file or a torch.distributed.checkpoint directory)."""
    target = resolve(dst)
    if os.path.isdir(src):
        # a DCP directory: its .metadata may name any file in it (even a .safetensors), so no
        # existing file inside is written; a new one is not among those SRC reads
        if target[0] == resolve(src)[0] and _inside_existing(src, dst):
            raise UsageError(
                f"DST {dst} is a file inside SRC's torch.distributed.checkpoint directory {src}, which "
                "SRC may read: convert never overwrites its input; give another DST"
            )
        return
    for i, (what, url) in enumerate(input_files(src, header)):
        if _same(resolve(url), target):
            broken = f" (writing it would break {src})" if i else ""
            raise UsageError(
                f"DST {dst} is {what}: convert never overwrites its input{broken}; give another DST"
            )
