"""Memory sizes and counts as people write them ('80GB', '141 GiB', '6.7B'); no torch import."""

from __future__ import annotations

import argparse
import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}

# Each range is what the planner can build and trace in seconds, wide enough for any model
# trained today; a value outside it is a usage error before anything is read or built.
RANGES = {
    "params": (1, 10**15),
    "layers": (1, 1024),
    "hidden": (1, 2**17),
    "heads": (1, 2**17),
    "kv_heads": (1, 2**17),
    "ffn": (1, 2**20),
    "vocab": (1, 2**24),
    "seq": (1, 2**22),
    "batch": (1, 2**20),
    "gpus": (1, 2**16),
    "gpu_memory": (1, 2**50),
    "loss_chunks": (1, 2**16),
}
"""The documented range of each numeric option of `coatstate plan` (docs/planner.md)."""


def check_range(name: str, value: int, where: str) -> None:
    """ValueError when a model number (from flags, a config or a Shape) is outside RANGES[name]:
    a config with n_layer 1e8 is refused before anything is built, as --layers 1e8 is."""
    low, high = RANGES[name]
    if not low <= value <= high:
        raise ValueError(
            f"{where}={value:,} is outside {low:,} to {high:,}, the range of --{name.replace('_', '-')}; "
            "fix the value (docs/planner.md lists the ranges)"
        )


def parse_bytes(text: str) -> int:
    """'80GB', '141 GiB', '8e10' -> bytes (a bare number is bytes; GB = 1e9, GiB = 2**30)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    number = _number(m.group(1)) if m else None
    if number is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size: write e.g. 80GB, 141GiB or a number of bytes"
        )
    return _whole(number * _UNITS[unit], text, "memory size")


def parse_count(text: str) -> int:
    """'6.7B', '355M', '7e9' -> an integer count."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMbBtT]?)\s*", str(text))
    number = _number(m.group(1)) if m else None
    if number is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: write e.g. 6.7B, 355M or 7e9")
    return _whole(number * _COUNT_SUFFIX[m.group(2).lower()], text, "count")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # '..', '1e': the pattern lets through what float() refuses
        return None


def _whole(value: float, text: str, what: str) -> int:
    # float('1e400') is infinity, which has no int (OverflowError is no ValueError: argparse
    # would let it through as a traceback)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is too large for a {what}")
    return int(value)
