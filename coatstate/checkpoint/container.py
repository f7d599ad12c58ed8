"""The safetensors container of coatstate checkpoints, and the zstandard tensor encoding.

The writer streams the standard safetensors layout (8-byte little-endian header length, JSON
header padded with spaces to a multiple of 8, then the tensor bytes) straight into the output
file, where safetensors.torch.save would first build the whole file as one bytes object.
Reading goes through safetensors.torch.load, so every file written here is checked by the
reference parser.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch
from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError

from coatstate.checkpoint.storage import read_bytes

ZSTD_LEVEL = 3
"""Higher levels buy nothing on FP8 codes (docs/CHECKPOINT.md)."""
ZSTD_MIN_BYTES = 4096
"""Tensors smaller than this are stored raw even when zstd is on."""


def _entries(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    # widest dtypes first keeps every tensor aligned to its element size (as safetensors does)
    items = list(tensors.items())
    return sorted(items, key=lambda kv: -kv[1].element_size())


def safetensors_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The first bytes of a safetensors file holding `tensors` in `_entries` order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, t in _entries(tensors):
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": schema.DTYPES[schema.dtype_name(t.dtype)][0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """Stream a safetensors file into `f`; returns the bytes written. Tensors must be on the CPU."""
    head = safetensors_header(tensors, metadata)
    f.write(head)
    written = len(head)
    for _, t in _entries(tensors):
        view = schema.tensor_bytes(t)
        f.write(view)
        written += len(view)
    return written


def parse_header(head: bytes, where: str) -> tuple[int, dict[str, Any]]:
    """(data start offset, header dict) from the first bytes of a safetensors file."""
    if len(head) < 8:
        raise CheckpointError(f"{where}: file is {len(head)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > schema.MAX_HEADER_BYTES or 8 + n > len(head):
        raise CheckpointError(
            f"{where}: truncated or corrupt: header length {n} but only {len(head)} bytes read"
        )
    try:
        header = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (not a JSON object)")
    return 8 + n, header


def coatstate_header(st_header: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Our JSON header out of the safetensors metadata, its checksum verified."""
    meta = st_header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(schema.METADATA_KEY), str):
        raise CheckpointError(
            f"{where}: not a coatstate checkpoint (no {schema.METADATA_KEY!r} entry in the safetensors "
            "metadata); read a plain safetensors file with safetensors.torch.load_file"
        )
    text = meta[schema.METADATA_KEY]
    if meta.get(schema.HEADER_CHECKSUM_KEY) != schema.header_checksum(text):
        raise CheckpointError(f"{where}: header checksum mismatch: the file is corrupt")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: corrupt coatstate header ({e})") from None
    return schema.check_header(header, where)


def load_tensors(data: bytes, where: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file held in `data` (through the reference parser)."""
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as e:  # safetensors raises its own SafetensorError, struct errors, ...
        raise CheckpointError(f"{where}: truncated or corrupt safetensors data ({e})") from None


# ---------------------------------------------------------------------------------- zstandard
def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "compress='zstd' (or reading a zstd-compressed checkpoint) needs the zstandard package: "
            "pip install zstandard"
        ) from None
    return zstandard


def zstd_compress(data: memoryview, level: int = ZSTD_LEVEL) -> bytes:
    z = _zstd()
    return z.ZstdCompressor(level=level, write_checksum=True, write_content_size=True, threads=-1).compress(
        data
    )


def zstd_decompress(blob: memoryview | bytes, expected_size: int, where: str) -> bytes:
    z = _zstd()
    try:
        out = z.ZstdDecompressor().decompress(blob, max_output_size=expected_size)
    except z.ZstdError as e:
        raise CheckpointError(f"{where}: corrupt zstd frame ({e})") from None
    if len(out) != expected_size:
        raise CheckpointError(f"{where}: zstd frame holds {len(out)} bytes, expected {expected_size}")
    return out


def read_head(url: str, where: str) -> tuple[bytes, int, dict[str, Any]]:
    """(the bytes read, data start, safetensors header) reading only the header of `url`."""
    head = read_bytes(url, length=64 * 1024)
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n > len(head) and n <= schema.MAX_HEADER_BYTES:
            head = read_bytes(url, length=8 + n)
    start, header = parse_header(head, where)
    return head, start, header
