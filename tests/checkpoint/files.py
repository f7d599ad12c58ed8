"""What the checkpoint tests share to craft files (the S3 bucket fixture is in conftest.py)."""

from __future__ import annotations

import hashlib
import json
import struct


def with_header(data: bytes, edit=None, *, edit_text=None, outer_text=None) -> bytes:
    """The file `data` with its coatstate header edited and the header checksum recomputed:
    `edit(header)` changes the parsed header in place, `edit_text(text)` returns new header text,
    `outer_text(text)` the safetensors header's whole text."""
    n = struct.unpack("<Q", data[:8])[0]
    outer = json.loads(data[8 : 8 + n])
    text = outer["__metadata__"]["coatstate"]
    if edit is not None:
        header = json.loads(text)
        edit(header)
        text = json.dumps(header, separators=(",", ":"))
    if edit_text is not None:
        text = edit_text(text)
    outer["__metadata__"]["coatstate"] = text
    outer["__metadata__"]["coatstate.header_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    head = json.dumps(outer, separators=(",", ":"))
    if outer_text is not None:
        head = outer_text(head)
    head = head.encode() + b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data[8 + n :]
