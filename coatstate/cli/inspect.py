"""`coatstate inspect FILE`: what a checkpoint holds, from its header (and, with --verify, every
tensor checked against its checksum); also describes a torch .pt optimizer state dict."""

from __future__ import annotations

import argparse
import builtins
import json
import math
import os
from typing import Any

from coatstate.cli.common import (
    PT_EXTENSIONS,
    checkpoint_error,
    extension,
    human_bytes,
    printable,
    stored_bytes,
)

VERIFIED = "all verified"
NOT_VERIFIED = "not verified (--verify reads and checks every tensor)"
PT_CHECKSUMS = "none, as a torch .pt file holds no checksums (torch.load read it with weights_only=True)"
"""What `inspect` says of checksums for a .pt, with or without --verify (there is nothing to check)."""


def add_inspect_parser(sub) -> None:
    """Register `inspect` on the `coatstate` subcommand parser."""
    i = sub.add_parser(
        "inspect",
        help="what a checkpoint holds (reads the header only unless --verify)",
        description="Describe a coatstate .safetensors checkpoint (or a torch .pt optimizer state dict). "
        "Prints the optimizer and its step, each param group's settings, each parameter's shape, state "
        "bytes and format (fp32 or FP8 with its group size; master weights), the optimizer state's bytes "
        "per parameter and its ratio to torch AdamW's, the model's and the files' sizes, and whether "
        "checksums were verified (--json: the same as one JSON object).",
    )
    i.add_argument("file", help="a .safetensors checkpoint (local path or fsspec URL) or a torch .pt")
    i.add_argument(
        "--verify", action="store_true", help="read every tensor and check its checksum (a .pt has none)"
    )
    i.add_argument("--json", action="store_true", help="print JSON for scripts")
    i.add_argument("--all", action="store_true", help="list every parameter (default: the first 20)")
    i.set_defaults(run=cmd_inspect)


def _numel(shape) -> int:
    return math.prod(shape) if shape is not None else 0


def _nbytes(info: dict[str, Any]) -> int:
    from coatstate.formats import schema

    return _numel(info["shape"]) * schema.DTYPES[info["dtype"]][1]


def _read_step(file_url: str, key: str, dtype_name: str) -> float | None:
    from coatstate.checkpoint import container, storage
    from coatstate.formats import schema

    _, start, st_header = container.read_head(file_url, file_url)
    data_bytes = storage.file_size(file_url) - start
    begin, end = container.tensor_span(st_header, key, data_bytes, file_url)
    dtype = schema.torch_dtype(dtype_name)
    if end - begin != dtype.itemsize:
        raise checkpoint_error(f"{file_url}: tensor {key!r} holds {end - begin} bytes, not one {dtype_name}")
    raw = storage.read_range(file_url, start + begin, end - begin)
    if len(raw) != end - begin:
        raise checkpoint_error(f"{file_url}: truncated: tensor {key!r} lies past the end of the file")
    import torch

    return float(torch.frombuffer(bytearray(raw), dtype=dtype)[0])


def _first_step(url: str, header: dict[str, Any]) -> float | None:
    """The step of the first parameter with state, reading only its bytes."""
    from coatstate.checkpoint import storage

    for pstate in header["state"].values():
        ref = pstate.get("step")
        if isinstance(ref, (int, float)) and not isinstance(ref, bool):
            return float(ref)
        if not (isinstance(ref, dict) and "$tensor" in ref):
            continue
        key, file_url = ref["$tensor"], url
        if header.get("per_rank") is not None:  # a per-rank root: the rows of rank 0's file
            from coatstate.checkpoint import rank_read

            return float(rank_read.read_tensor(url, header, key).reshape(-1)[0])
        for shard in header.get("shards") or []:
            if key in shard["tensors"]:  # (read()'s rule: no symlink out of the directory)
                file_url = storage.sibling_inside(url, shard["file"], "shard")
        try:
            return _read_step(file_url, key, header["tensors"][key]["dtype"])
        except FileNotFoundError:
            raise checkpoint_error(f"{url}: shard {os.path.basename(file_url)} is missing") from None
    return None


def check_sizes(url: str, header: dict[str, Any]) -> None:
    """Without --verify too: every tensor's data offsets lie inside the file, and every shard or
    rank file the root names has the size the root records (a truncated file is an error)."""
    from coatstate.checkpoint import container, storage

    _, start, st_header = container.read_head(url, url)
    data_bytes = storage.file_size(url) - start
    for key in st_header:
        if key != "__metadata__":
            container.tensor_span(st_header, key, data_bytes, url)
    kinds = [("shard", s) for s in header.get("shards") or []]
    kinds += [("rank file", f) for f in (header.get("per_rank") or {}).get("files", [])]
    for what, part in kinds:
        try:
            size = storage.file_size(storage.sibling_inside(url, part["file"], what))
        except FileNotFoundError:
            raise checkpoint_error(f"{url}: {what} {part['file']} is missing") from None
        if size != part["bytes"]:
            raise checkpoint_error(
                f"{url}: {what} {part['file']} is {size} bytes, the root records {part['bytes']}: truncated "
                "or replaced"
            )


def summarize(header: dict[str, Any], *, file_bytes: int, step: float | None) -> dict[str, Any]:
    """What `inspect` reports, as a JSON-able dict."""
    from coatstate.formats import schema

    tensors = header["tensors"]
    state_raw = sum(_nbytes(i) for k, i in tensors.items() if k.startswith(schema.STATE_PREFIX + "/"))
    model_raw = sum(_nbytes(i) for k, i in tensors.items() if k.startswith(schema.MODEL_PREFIX + "/"))
    params, compressed, full, fp32_adamw = [], 0, 0, 0
    amsgrad = any(bool(g.get("amsgrad")) for g in header["param_groups"])
    for pid, info in header["params"].items():
        pstate = header["state"].get(pid, {})
        numel = _numel(info.get("shape"))
        pbytes = sum(
            _nbytes(tensors[v["$tensor"]]) for v in pstate.values() if isinstance(v, dict) and "$tensor" in v
        )
        formats = info.get("compressed") or {}
        if pstate:
            fp32_adamw += 4 + numel * (12 if amsgrad else 8)
            compressed, full = compressed + (numel if formats else 0), full + (0 if formats else numel)
        fmt = ", ".join(
            f"{m}={f['format']}{'+exp' if f['expand'] else ''}/g{f['group_size']}" for m, f in formats.items()
        )
        fmt = fmt or ("fp32" if pstate else "no state")
        correction = pstate.get("master_correction")
        if isinstance(correction, dict) and "$tensor" in correction:  # a bfloat16 weight's master
            fmt += f", master={tensors[correction['$tensor']]['dtype'].lower()}"
        params.append(
            {
                "id": int(pid),
                "name": info.get("name"),
                "shape": info.get("shape"),
                "state_bytes": pbytes,
                "format": fmt,
            }
        )
    elements = compressed + full
    return {
        "format_version": header["format_version"],
        "library_version": header.get("library_version"),
        "optimizer": header.get("optimizer"),
        "step": step,
        "param_groups": [
            {k: _plain(v) for k, v in g.items() if k != "params"} for g in header["param_groups"]
        ],
        "params": params,
        "compressed_elements": compressed,
        "full_precision_elements": full,
        "tensors": len(tensors),
        "optimizer_state_bytes": state_raw,
        "model_bytes": model_raw,
        "file_bytes": file_bytes,
        "compression": header.get("compression"),
        "shards": len(header.get("shards") or []) or None,
        "rank_files": len((header.get("per_rank") or {}).get("files", [])) or None,
        "extra": sorted(header.get("extra") or {}) or None,  # save(..., extra=)'s keys
        "state_bytes_per_param": state_raw / elements if elements else None,
        "ratio_vs_fp32_adamw": state_raw / fp32_adamw if fp32_adamw else None,
    }


def _plain(value: Any) -> Any:
    """A header value for display: tuples and floats decoded, tensor references named."""
    if isinstance(value, dict) and "$tensor" in value:
        return f"<tensor {value['$tensor']}>"
    if isinstance(value, dict) and "$tuple" in value:
        return tuple(_plain(v) for v in value["$tuple"])
    if isinstance(value, dict) and "$float" in value:
        return float(value["$float"])
    return value


def _print_summary(url: str, s: dict[str, Any], checksums: str, show_all: bool) -> None:
    def print(line: str) -> None:  # every line of the report, whatever the file holds
        builtins.print(printable(line))

    opt = s["optimizer"] or {}
    if s["format_version"] is None:
        print(f"{url}: torch.save optimizer state dict (read with weights_only=True)")
    else:
        print(
            f"{url}: coatstate checkpoint v{s['format_version']} "
            f"(written by coatstate {s['library_version']})"
        )
    print(f"optimizer: {opt.get('class') or 'state dict'} ({opt.get('variant')} states), step {s['step']}")
    for i, g in enumerate(s["param_groups"]):
        keys = (
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "amsgrad",
            "group_size",
            "exp_avg_format",
            "exp_avg_sq_format",
            "master_bits",
        )
        print(f"group {i}: " + ", ".join(f"{k}={g[k]}" for k in keys if k in g))
    print(
        f"params: {len(s['params'])}; elements {s['compressed_elements']:,} compressed, "
        f"{s['full_precision_elements']:,} in fp32"
    )
    shown = s["params"] if show_all else s["params"][:20]
    width = max([len(str(p["name"] or p["id"])) for p in shown] + [4])
    for p in shown:
        print(
            f"  {str(p['name'] or p['id']):<{width}}  {str(p['shape']):<18} "
            f"{human_bytes(p['state_bytes']):>12}  {p['format']}"
        )
    if len(shown) < len(s["params"]):
        print(f"  ... {len(s['params']) - len(shown)} more (--all lists them)")
    bpp = s["state_bytes_per_param"]
    print(
        f"optimizer state: {human_bytes(s['optimizer_state_bytes'])}"
        + (f", {bpp:.3f} bytes/param" if bpp is not None else "")
        + (f", {s['ratio_vs_fp32_adamw']:.3f}x of fp32 AdamW" if s["ratio_vs_fp32_adamw"] else "")
    )
    print(
        f"model: {human_bytes(s['model_bytes'])}; file: {human_bytes(s['file_bytes'])} "
        f"({s['tensors']} tensors, compression {s['compression']}, "
        + (f"per rank: {s['rank_files']} files)" if s["rank_files"] else f"shards {s['shards'] or 1})")
    )
    if s["extra"]:
        print(f"extra (the run's other state): {', '.join(s['extra'])}")
    print(f"checksums: {checksums}")


def _is_pt(url: str, head: bytes) -> bool:
    return head == b"PK\x03\x04" or extension(url) in PT_EXTENSIONS


def cmd_inspect(args: argparse.Namespace) -> int:
    from coatstate.checkpoint import api as checkpoint
    from coatstate.checkpoint import encoding, shards, storage

    url = args.file
    if os.path.isdir(url):
        raise checkpoint_error(
            f"{url}: is a directory; inspect reads a .safetensors or .pt file (convert a "
            "torch.distributed.checkpoint directory to .safetensors first)"
        )
    head = storage.read_bytes(url, length=4)
    if _is_pt(url, head):  # a torch.save file: read it (weights_only) and describe it
        ckpt = checkpoint.read(url)
        try:
            _, header = encoding.flatten(ckpt.optimizer, {}, {}, None)
        except (TypeError, ValueError) as e:
            raise checkpoint_error(f"{url}: cannot describe this state dict ({e})") from None
        header["optimizer"]["class"] = "torch optimizer"
        s = summarize(header, file_bytes=storage.file_size(url), step=None)
        s.update(step=_first_step_from(ckpt.optimizer), format_version=None, library_version=None)
        checksums = PT_CHECKSUMS
    else:
        for attempt in range(3):  # a concurrent save may replace the root and remove its shards
            header = checkpoint.read_header(url)
            try:
                if args.verify:
                    checkpoint.read(url, verify=True)
                else:
                    check_sizes(url, header)
                s = summarize(header, file_bytes=stored_bytes(url, header), step=_first_step(url, header))
                break
            except (shards.ShardMissing, FileNotFoundError):
                if attempt == 2 or checkpoint.read_header(url) == header:
                    raise
        checksums = VERIFIED if args.verify else NOT_VERIFIED
    if args.json:
        print(
            json.dumps({**s, "checksums_verified": checksums == VERIFIED, "checksums": checksums}, indent=1)
        )
    else:
        _print_summary(url, s, checksums, args.all)
    return 0


def _first_step_from(sd: dict[str, Any]) -> float | None:
    for pstate in sd["state"].values():
        if "step" in pstate:
            try:
                return float(pstate["step"])
            except (TypeError, ValueError, RuntimeError):
                return None
    return None
