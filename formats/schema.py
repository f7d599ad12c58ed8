"""The on-disk schema of coatstate checkpoints (docs/CHECKPOINT.md is the prose spec).

Pure bookkeeping: tensor key naming, the JSON header that travels in the safetensors metadata,
version constants, the tagged JSON encoding of non-tensor values, and checksum helpers.
Nothing here knows about optimizers or files.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

FORMAT_NAME = "coatstate.checkpoint"
"""The magic: the `format` field of every header."""
FORMAT_VERSION = 2
"""The one version every file this library writes carries (single files, sharded roots, per-rank
headers) and the only one its readers accept: others are refused with the fix. Bumped on any
change an older reader would misread."""
METADATA_KEY = "coatstate"
"""safetensors metadata key holding the JSON header."""
HEADER_CHECKSUM_KEY = "coatstate.header_sha256"
"""safetensors metadata key holding sha256 (hex) of the JSON header string."""
CHECKSUM_ALGORITHM = "sha256"
"""Per-tensor checksum: sha256 over the tensor's raw little-endian bytes (before any zstd)."""
MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on the JSON header."""
MAX_JSON_DEPTH = 64
"""Deepest nesting a header may have: ours is about 6 deep, and a bound keeps every recursive
walk of it far from Python's recursion limit."""

STATE_PREFIX = "state"
MODEL_PREFIX = "model"
EXTRA_PREFIX = "extra"
"""Tensors of `save(..., extra=)`: 'extra/{n}', numbered in the order the walk meets them."""
GROUPS_PREFIX = "param_groups"

# torch dtype name <-> safetensors dtype string, and bytes per element
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit what it is loaded into.

    Raised by `coatstate.save`, `load`, `read` and the CLI for: a truncated or corrupt file
    (header or tensor checksum mismatch, bad offsets, a corrupt zstd frame), wrong magic or an
    unsupported format version, a header that breaks the schema, a missing shard or rank file, a
    path that is not a regular file, and, in `load`, a mismatch with the optimizer or model (class,
    param counts, shapes, model keys or dtypes). The message starts with the file and names the
    problem; a subclass of ValueError, so `except ValueError` catches it too.

    Example:
        >>> try:
        ...     coatstate.load(opt, "run/step1000.safetensors")
        ... except coatstate.CheckpointError as e:
        ...     print(e)  # run/step1000.safetensors: header checksum mismatch: the file is corrupt
    """


# ---------------------------------------------------------------------------------------- keys
def state_key(param_id: int, name: str) -> str:
    """'state/{param_id}/{name}': one per-parameter optimizer state tensor."""
    return f"{STATE_PREFIX}/{int(param_id)}/{name}"


def model_key(name: str) -> str:
    """'model/{name}': one tensor of the model's state dict."""
    return f"{MODEL_PREFIX}/{name}"


def group_key(group_index: int, name: str) -> str:
    """'param_groups/{index}/{name}': a tensor-valued hyperparameter (e.g. a tensor lr)."""
    return f"{GROUPS_PREFIX}/{int(group_index)}/{name}"


def extra_key(index: int) -> str:
    """'extra/{index}': a tensor inside the run state given as `save(..., extra=)`."""
    return f"{EXTRA_PREFIX}/{int(index)}"


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32; raises for dtypes safetensors cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"cannot store a {dtype} tensor in a checkpoint; supported: {sorted(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in the header")
    return getattr(torch, name)


# ------------------------------------------------------------------------------------ checksums
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (contiguous, any dtype), without a copy when possible.

    The view is writable (readers fill a tensor through it) and keeps the tensor alive.
    """
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor; got one on {flat.device} (call .cpu() first)")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    # ctypes rather than Tensor.numpy(): torch's wheels do not depend on numpy, and without it
    # .numpy() raises "Numpy is not available" on a plain install
    buffer = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    buffer._tensor = flat  # the memoryview holds `buffer`, `buffer` holds the memory's owner
    return memoryview(buffer).cast("B")


def checksum(data: bytes | memoryview) -> str:
    """'sha256:<hex>' of `data` (docs/CHECKPOINT.md says why sha256, not blake2b)."""
    return f"{CHECKSUM_ALGORITHM}:{hashlib.sha256(data).hexdigest()}"


def tensor_checksum(t: torch.Tensor) -> str:
    return checksum(tensor_bytes(t))


def tensor_checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{key: checksum} computed on a thread pool (hashlib releases the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    keys = list(tensors)
    if len(keys) < 2:
        return {k: tensor_checksum(tensors[k]) for k in keys}
    with ThreadPoolExecutor(max_workers=min(len(keys), os.cpu_count() or 1)) as pool:
        return dict(zip(keys, pool.map(lambda k: tensor_checksum(tensors[k]), keys), strict=True))


def header_checksum(header_json: str) -> str:
    return hashlib.sha256(header_json.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------- tagged JSON values
def encode_value(value: Any, where: str) -> Any:
    """JSON for a hyperparameter or non-tensor state value; tuples and non-finite floats tagged.

    Tensors are not handled here (the caller stores them as tensors and writes {"$tensor": key}).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        if any(k.startswith("$") for k in value):
            raise TypeError(f"{where}: dict keys starting with '$' are reserved; got {sorted(value)}")
        return {k: encode_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, Mapping) and all(k is None or isinstance(k, (bool, int, float, str)) for k in value):
        return {"$items": [[k, encode_value(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(
        f"{where}: cannot store a value of type {type(value).__name__} ({value!r:.80}) in a "
        "checkpoint header; only None, bool, int, float, str, tuples, lists, str-keyed dicts "
        "and tensors are stored"
    )


NONFINITE_FLOATS = ("inf", "-inf", "nan")
"""The only values of a {"$float": ...} tag (encode_value writes repr() of non-finite floats)."""


def tag_problem(value: Mapping[str, Any]) -> str | None:
    """Why a dict with a reserved '$' key is not a valid tag, or None for a valid one (or a plain dict)."""
    tags = [k for k in value if isinstance(k, str) and k.startswith("$")]
    if not tags:
        return None
    if len(value) != 1:
        return f"a tag must be the only key of its object; got keys {sorted(map(str, value))[:5]}"
    tag, inner = tags[0], value[tags[0]]
    if tag == "$tuple":
        return None if isinstance(inner, list) else "$tuple must hold a list"
    if tag == "$float":
        return (
            None if inner in NONFINITE_FLOATS else f"$float must be one of {NONFINITE_FLOATS}; got {inner!r}"
        )
    if tag == "$tensor":
        return None if isinstance(inner, str) else "$tensor must hold a tensor key (a string)"
    if tag == "$items":
        pairs = isinstance(inner, list) and all(isinstance(p, list) and len(p) == 2 for p in inner)
        keys_ok = pairs and all(p[0] is None or isinstance(p[0], (bool, int, float, str)) for p in inner)
        return None if keys_ok else "$items must hold [key, value] pairs with plain keys"
    return f"unknown tag {tag!r} (keys starting with '$' are reserved)"


def decode_value(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `encode_value`; {"$tensor": key} is looked up in `tensors`."""
    if isinstance(value, list):
        return [decode_value(v, tensors) for v in value]
    if isinstance(value, dict):
        problem = tag_problem(value)
        if problem:
            raise CheckpointError(f"invalid tagged value in the header: {problem}")
        if "$tuple" in value:
            return tuple(decode_value(v, tensors) for v in value["$tuple"])
        if "$float" in value:
            return float(value["$float"])
        if "$items" in value:  # a dict whose keys are not all strings (a Counter of milestones)
            return {k: decode_value(v, tensors) for k, v in value["$items"]}
        if "$tensor" in value:
            key = value["$tensor"]
            if key not in tensors:
                raise CheckpointError(f"tensor {key!r} named in the header is missing from the file")
            return tensors[key]
        return {k: decode_value(v, tensors) for k, v in value.items()}
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON literal {name} (the header is strict JSON)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), walked without recursion; stops past `limit`."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            d += 1
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def loads_json(text: str | bytes, where: str, what: str = "header") -> Any:
    """Strict JSON: no NaN/Infinity literals, no duplicate keys, at most MAX_JSON_DEPTH deep.

    Any violation (or a parser hitting the recursion limit on deep nesting) is a CheckpointError
    naming `where` and the problem.
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise CheckpointError(
            f"{where}: corrupt {what}: JSON nested deeper than Python's recursion limit"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{where}: corrupt {what} ({e})") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise CheckpointError(f"{where}: corrupt {what}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def dump_header(header: Mapping[str, Any]) -> str:
    """Strict JSON (no NaN/Infinity literals), compact."""
    return json.dumps(header, separators=(",", ":"), allow_nan=False)


def version_problem(version: Any) -> str:
    """Why a header of `version` is refused, and the fix: one line for a CheckpointError."""
    reads = f"this coatstate reads format version {FORMAT_VERSION} only"
    if type(version) is int and version == 1:
        return (
            f"format version 1 (coatstate 0.1) is not supported ({reads}); convert it with coatstate "
            "0.1 to torch AdamW states (`coatstate convert OLD.safetensors OLD.pt`) and load that"
        )
    if type(version) is int and version > FORMAT_VERSION:
        return f"format version {version} is not supported ({reads}); upgrade coatstate to read it"
    return f"format version {version!r:.40} is not supported ({reads}): the header is corrupt"


def check_header(header: Any, where: str) -> dict[str, Any]:
    """Validate the magic, the version and the field types a reader relies on."""
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        found = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise CheckpointError(
            f"{where}: not a coatstate checkpoint (format {found!r}, expected {FORMAT_NAME!r})"
        )
    version = header.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise CheckpointError(f"{where}: {version_problem(version)}")
    expected = {"tensors": dict, "param_groups": list, "state": dict, "params": dict}
    for field, kind in expected.items():
        if not isinstance(header.get(field), kind):
            raise CheckpointError(f"{where}: header field {field!r} is missing or not a {kind.__name__}")
    return header
