"""What every `coatstate` command shares: the usage error, file extensions, byte sizes for
people, and argparse types that check a number's range while the arguments are parsed.

Imports nothing heavy: the parser builds from these without torch.
"""

from __future__ import annotations

import argparse
import os
import unicodedata
from collections.abc import Callable
from typing import Any

PT_EXTENSIONS = (".pt", ".pth", ".bin")
ST_EXTENSIONS = (".safetensors",)


class UsageError(Exception):
    """Bad command-line arguments: exit code 2."""


def checkpoint_error(message: str) -> Exception:
    """A CheckpointError (exit code 1), imported only when one is raised."""
    from coatstate.formats.schema import CheckpointError

    return CheckpointError(message)


def printable(text: str) -> str:
    """`text` with control and format characters escaped (`\\n`, `\\x1b`, `\\u202e`): what the
    CLI prints of a file's strings or a user's path stays on its line and cannot drive the
    terminal (a name holding a newline could print a fake `checksums: all verified` line)."""
    shown = (c if c == " " or unicodedata.category(c)[0] not in "CZ" else ascii(c)[1:-1] for c in text)
    return "".join(shown)


def extension(path: str) -> str:
    return os.path.splitext(path.rstrip("/"))[1].lower()


def human_bytes(n: int) -> str:
    """One size format for every command: '1.23 GB' (powers of 1000, as `plan` prints)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def stored_bytes(url: str, header: dict[str, Any]) -> int:
    """Bytes of a checkpoint: its root plus every shard or rank file the root names."""
    from coatstate.checkpoint import storage

    parts = (header.get("shards") or []) + (header.get("per_rank") or {}).get("files", [])
    return storage.file_size(url) + sum(s["bytes"] for s in parts)


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], else a usage error naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low:,} to {high:,}; got {value:,}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def in_range(
    parse_text: Callable[[str], int | float], low: int, high: int, what: str
) -> Callable[[str], int]:
    """An argparse type: parse_text's value (a size or count as people write it) in [low, high]."""

    def parse(text: str) -> int:
        value = parse_text(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be from {low:,} to {high:,}; got {value:,}")
        return int(value)

    parse.__name__ = what
    return parse


def regex(text: str) -> str:
    """An argparse type: a regular expression that compiles."""
    import re

    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e})") from None
    return text
