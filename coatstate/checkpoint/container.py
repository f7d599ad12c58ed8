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
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch

from coatstate.checkpoint.storage import read_bytes
from coatstate.checkpoint.validate import validate_header
from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError

ZSTD_LEVEL = 3
"""Higher levels buy nothing on FP8 codes (docs/CHECKPOINT.md)."""
ZSTD_MIN_BYTES = 4096
"""Tensors smaller than this are stored raw even when zstd is on."""
ZSTD_CHUNK_BYTES = 64 * 2**20
"""Decompressed per call: bounds zstd's own buffers whatever a frame claims."""


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
    if len(text) > schema.MAX_HEADER_BYTES:  # readers refuse it (parse_header): never write one
        raise CheckpointError(
            f"the checkpoint's header would be {len(text):,} bytes, over safetensors' limit of "
            f"{schema.MAX_HEADER_BYTES:,}: save fewer or larger tensors (or keep long values out of extra=)"
        )
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    f: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    before_each: Callable[[str, memoryview], None] | None = None,
) -> int:
    """Stream a safetensors file into `f`; returns the bytes written. Tensors must be on the CPU.
    `before_each(key, bytes)` runs before each tensor's bytes are written (in file order)."""
    head = safetensors_header(tensors, metadata)
    f.write(head)
    written = len(head)
    for key, t in _entries(tensors):
        view = schema.tensor_bytes(t)
        if before_each is not None:
            before_each(key, view)
        f.write(view)
        written += len(view)
    return written


def parse_header(head: bytes, where: str) -> tuple[int, dict[str, Any]]:
    """(data start offset, header dict) from the first bytes of a safetensors file."""
    if len(head) < 8:
        raise CheckpointError(f"{where}: file is {len(head)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > schema.MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{where}: not a safetensors file, or corrupt: its first 8 bytes give a header length of {n}, "
            f"over safetensors' limit of {schema.MAX_HEADER_BYTES}"
        )
    if 8 + n > len(head):
        raise CheckpointError(
            f"{where}: truncated or corrupt: header length {n} but the file has {len(head)} bytes"
        )
    try:
        text = head[8 : 8 + n].decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: corrupt safetensors header ({e})") from None
    header = schema.loads_json(text, where, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (not a JSON object)")
    return 8 + n, header


def coatstate_header(st_header: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Our JSON header out of the safetensors metadata, its checksum verified, its schema checked."""
    meta = st_header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(schema.METADATA_KEY), str):
        raise CheckpointError(
            f"{where}: not a coatstate checkpoint (no {schema.METADATA_KEY!r} entry in the safetensors "
            "metadata); read a plain safetensors file with safetensors.torch.load_file"
        )
    text = meta[schema.METADATA_KEY]
    try:
        checksum = schema.header_checksum(text)
    except UnicodeEncodeError:  # a lone surrogate (\ud800) in the JSON: no writer of ours made it
        checksum = None
    if checksum is None or meta.get(schema.HEADER_CHECKSUM_KEY) != checksum:
        raise CheckpointError(f"{where}: header checksum mismatch: the file is corrupt")
    return validate_header(schema.loads_json(text, where, "coatstate header"), where)


def tensor_span(st_header: Mapping[str, Any], key: str, data_bytes: int, where: str) -> tuple[int, int]:
    """(begin, end) of tensor `key` within the data section, checked against the data's size."""
    entry = st_header.get(key)
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{where}: tensor {key!r} is listed in the coatstate header but not in the safetensors header"
        )
    span = entry.get("data_offsets")
    if not (
        isinstance(span, list)
        and len(span) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
        and 0 <= span[0] <= span[1] <= data_bytes
    ):
        raise CheckpointError(
            f"{where}: tensor {key!r} has data offsets {span!r:.60} outside the file's "
            f"{data_bytes} data bytes: truncated or corrupt"
        )
    return span[0], span[1]


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
            "compress='zstd' (or reading a zstd-compressed checkpoint) needs the zstandard package, the "
            "`zstd` extra: pip install 'coatstate[zstd]' (or pip install zstandard)"
        ) from None
    return zstandard


def zstd_compress(data: memoryview, level: int = ZSTD_LEVEL) -> bytes:
    z = _zstd()
    return z.ZstdCompressor(level=level, write_checksum=True, write_content_size=True, threads=-1).compress(
        data
    )


def zstd_decompress_into(blob: memoryview | bytes, out: memoryview, where: str) -> None:
    """Decompress the zstd frame `blob` into `out`, which must be exactly its content size.

    The frame's claimed size is compared with `out` before anything is decompressed, and the
    output goes straight into `out` in chunks of ZSTD_CHUNK_BYTES: a small frame that claims a huge
    tensor never costs more than the tensor the header describes (no second copy as bytes)."""
    z = _zstd()
    try:
        claimed = z.frame_content_size(blob)
    except z.ZstdError as e:
        raise CheckpointError(f"{where}: corrupt zstd frame ({e})") from None
    if claimed != len(out):  # checked before the frame allocates what it claims
        raise CheckpointError(f"{where}: zstd frame holds {claimed} bytes, expected {len(out)}")
    got = 0
    try:
        with z.ZstdDecompressor().stream_reader(blob) as reader:
            while got < len(out):
                n = reader.readinto(out[got : got + ZSTD_CHUNK_BYTES])
                if not n:
                    break
                got += n
            trailing = reader.read(1)  # reading to the frame's end checks its checksum
    except z.ZstdError as e:
        raise CheckpointError(f"{where}: corrupt zstd frame ({e})") from None
    if got != len(out) or trailing:
        raise CheckpointError(f"{where}: zstd frame holds {got + len(trailing)}+ bytes, expected {len(out)}")


def read_head(url: str, where: str) -> tuple[bytes, int, dict[str, Any]]:
    """(the bytes read, data start, safetensors header) reading only the header of `url`."""
    head = read_bytes(url, length=64 * 1024)
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n > len(head) and n <= schema.MAX_HEADER_BYTES:
            head = read_bytes(url, length=8 + n)
    start, header = parse_header(head, where)
    return head, start, header
