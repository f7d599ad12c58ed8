"""The `coatstate` command: `inspect` a checkpoint, `convert` between torch AdamW and compressed,
`clean` what killed saves left next to a checkpoint, `plan` a job's memory.

Exit codes: 0 success, 1 a checkpoint problem (unreadable, corrupt, mismatched: one line on
stderr naming the file), 2 a usage error (one line). Nothing heavy is imported at module level:
the parser builds, and every --help prints, without importing torch.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
import warnings
from typing import Any

PT_EXTENSIONS = (".pt", ".pth", ".bin")
ST_EXTENSIONS = (".safetensors",)
DEBUG_ENV = "COATSTATE_TRACEBACK"
"""Set to 1 to get the traceback of an unexpected error instead of its one-line summary."""


class UsageError(Exception):
    """Bad command-line arguments: exit code 2."""


def _checkpoint_error(message: str) -> Exception:
    from coatstate.formats.schema import CheckpointError

    return CheckpointError(message)


# ----------------------------------------------------------------------------------- inspect
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
        raise _checkpoint_error(f"{file_url}: tensor {key!r} holds {end - begin} bytes, not one {dtype_name}")
    raw = storage.read_range(file_url, start + begin, end - begin)
    if len(raw) != end - begin:
        raise _checkpoint_error(f"{file_url}: truncated: tensor {key!r} lies past the end of the file")
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
            if key in shard["tensors"]:
                file_url = storage.sibling_url(url, shard["file"])
        try:
            return _read_step(file_url, key, header["tensors"][key]["dtype"])
        except FileNotFoundError:
            raise _checkpoint_error(f"{url}: shard {os.path.basename(file_url)} is missing") from None
    return None


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
        "state_bytes_per_param": state_raw / elements if elements else None,
        "ratio_vs_fp32_adamw": state_raw / fp32_adamw if fp32_adamw else None,
    }


def _mb(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def _plain(value: Any) -> Any:
    """A header value for display: tuples and floats decoded, tensor references named."""
    if isinstance(value, dict) and "$tensor" in value:
        return f"<tensor {value['$tensor']}>"
    if isinstance(value, dict) and "$tuple" in value:
        return tuple(_plain(v) for v in value["$tuple"])
    if isinstance(value, dict) and "$float" in value:
        return float(value["$float"])
    return value


def _print_summary(url: str, s: dict[str, Any], verified: bool | None, show_all: bool) -> None:
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
        f"params: {len(s['params'])}; elements {s['compressed_elements']:,} in FP8, "
        f"{s['full_precision_elements']:,} in fp32"
    )
    shown = s["params"] if show_all else s["params"][:20]
    width = max([len(str(p["name"] or p["id"])) for p in shown] + [4])
    for p in shown:
        print(
            f"  {str(p['name'] or p['id']):<{width}}  {str(p['shape']):<18} "
            f"{_mb(p['state_bytes']):>12}  {p['format']}"
        )
    if len(shown) < len(s["params"]):
        print(f"  ... {len(s['params']) - len(shown)} more (--all lists them)")
    bpp = s["state_bytes_per_param"]
    print(
        f"optimizer state: {_mb(s['optimizer_state_bytes'])}"
        + (f", {bpp:.3f} bytes/param" if bpp is not None else "")
        + (f", {s['ratio_vs_fp32_adamw']:.3f}x of fp32 AdamW" if s["ratio_vs_fp32_adamw"] else "")
    )
    print(
        f"model: {_mb(s['model_bytes'])}; file: {_mb(s['file_bytes'])} "
        f"({s['tensors']} tensors, compression {s['compression']}, "
        + (f"per rank: {s['rank_files']} files)" if s["rank_files"] else f"shards {s['shards'] or 1})")
    )
    print(
        "checksums: "
        + {True: "all verified", None: "not verified (--verify reads and checks every tensor)"}[verified]
    )


def _file_bytes(url: str, header: dict[str, Any]) -> int:
    from coatstate.checkpoint import storage

    parts = (header.get("shards") or []) + (header.get("per_rank") or {}).get("files", [])
    return storage.file_size(url) + sum(s["bytes"] for s in parts)


def _is_pt(url: str, head: bytes) -> bool:
    return head == b"PK\x03\x04" or _ext(url) in PT_EXTENSIONS


def cmd_inspect(args: argparse.Namespace) -> int:
    from coatstate.checkpoint import api as checkpoint
    from coatstate.checkpoint import encoding, shards, storage

    url = args.file
    if os.path.isdir(url):
        raise _checkpoint_error(
            f"{url}: is a directory; inspect reads a .safetensors or .pt file (convert a "
            "torch.distributed.checkpoint directory to .safetensors first)"
        )
    head = storage.read_bytes(url, length=4)
    if _is_pt(url, head):  # a torch.save file: read it (weights_only) and describe it
        ckpt = checkpoint.read(url)
        try:
            _, header = encoding.flatten(ckpt.optimizer, {}, {}, None)
        except (TypeError, ValueError) as e:
            raise _checkpoint_error(f"{url}: cannot describe this state dict ({e})") from None
        header["optimizer"]["class"] = "torch optimizer"
        s = summarize(header, file_bytes=storage.file_size(url), step=None)
        s.update(step=_first_step_from(ckpt.optimizer), format_version=None, library_version=None)
        verified = None
    else:
        for attempt in range(3):  # a concurrent save may replace the root and remove its shards
            header = checkpoint.read_header(url)
            try:
                if args.verify:
                    checkpoint.read(url, verify=True)
                s = summarize(header, file_bytes=_file_bytes(url, header), step=_first_step(url, header))
                break
            except (shards.ShardMissing, FileNotFoundError):
                if attempt == 2 or checkpoint.read_header(url) == header:
                    raise
        verified = True if args.verify else None
    if args.json:
        print(json.dumps({**s, "checksums_verified": bool(verified)}, indent=1))
    else:
        _print_summary(url, s, verified, args.all)
    return 0


def _first_step_from(sd: dict[str, Any]) -> float | None:
    for pstate in sd["state"].values():
        if "step" in pstate:
            try:
                return float(pstate["step"])
            except (TypeError, ValueError, RuntimeError):
                return None
    return None


# ----------------------------------------------------------------------------------- convert
def _ext(path: str) -> str:
    return os.path.splitext(path.rstrip("/"))[1].lower()


def _direction(args: argparse.Namespace) -> str:
    if args.to:
        return args.to
    src, dst = _ext(args.src), _ext(args.dst)
    if os.path.isdir(args.src):  # a DCP directory: to .safetensors as it is, to .pt decompressed
        return "keep" if dst in ST_EXTENSIONS else "adamw"
    if src in PT_EXTENSIONS and dst in ST_EXTENSIONS:
        return "compressed"
    if src in ST_EXTENSIONS and dst in PT_EXTENSIONS:
        return "adamw"
    if src in ST_EXTENSIONS and dst in ST_EXTENSIONS:  # e.g. a per-rank checkpoint into one file
        return "keep"
    raise UsageError(
        f"cannot infer the direction from {args.src!r} -> {args.dst!r}: pass --to compressed or --to adamw"
    )


def _write_pt(obj: Any, url: str) -> None:
    import torch

    from coatstate.checkpoint import storage

    buf = io.BytesIO()
    torch.save(obj, buf)
    view = buf.getbuffer()
    storage.atomic_write(url, lambda f: f.write(view), len(view))


def _same_file(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _converted(what: str, src: str, fn, *args, **kwargs):
    """fn's result; a state it cannot convert is a checkpoint problem of SRC, said in one line."""
    from coatstate.formats.schema import CheckpointError

    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as e:
        raise _checkpoint_error(f"{src}: cannot {what} ({type(e).__name__}: {e})") from None


def _size_of(url: str) -> int:
    from coatstate.checkpoint import storage

    fs, path = storage.url_to_fs(url)
    return int(fs.du(path))


def cmd_convert(args: argparse.Namespace) -> int:
    from coatstate.checkpoint import api as checkpoint
    from coatstate.formats.optimizer_state import MOMENTS, is_compressed

    direction = _direction(args)
    if args.master_bits not in (None, "none") and (direction == "adamw" or _ext(args.dst) in PT_EXTENSIONS):
        raise UsageError("--master-bits 16/24/32 writes a bfloat16 model: DST must be a .safetensors file")
    if _ext(args.dst) not in PT_EXTENSIONS + ST_EXTENSIONS:
        raise UsageError(f"DST {args.dst!r} must end in one of {PT_EXTENSIONS + ST_EXTENSIONS}")
    if _same_file(args.src, args.dst):
        raise UsageError(f"SRC and DST are the same file ({args.src}): convert never overwrites its input")
    t0 = time.perf_counter()
    ckpt = checkpoint.read(args.src)
    sd = ckpt.optimizer
    has_codes = any(is_compressed(s, name) for s in sd["state"].values() for name in MOMENTS)
    names = {int(k): v["name"] for k, v in (ckpt.header.get("params") or {}).items() if v.get("name")}
    model = ckpt.model
    if args.master_bits is not None or direction == "adamw":
        model, sd = _master(args, ckpt, names)
    if direction == "keep":
        direction = "compressed" if has_codes else "adamw"
    elif direction == "compressed":
        if has_codes:
            raise _checkpoint_error(f"{args.src} already holds compressed states (convert --to adamw first)")
        from coatstate.optim import compress_adamw_state_dict

        options = {
            k: getattr(args, k) for k in ("group_size", "exp_avg_format", "exp_avg_sq_format", "min_numel")
        }
        options.update(exp_avg_expand=args.expand, exp_avg_sq_expand=args.expand)
        what = "compress its states (are they torch.optim.AdamW's?)"
        sd = _converted(what, args.src, compress_adamw_state_dict, sd, **options)
    elif has_codes:
        from coatstate.optim import to_adamw_state_dict

        sd = _converted("decompress its states", args.src, to_adamw_state_dict, sd)
    if _ext(args.dst) in ST_EXTENSIONS:
        _converted(
            "store its state dict",
            args.src,
            checkpoint.save,
            sd,
            args.dst,
            model=model,
            compress="zstd" if args.zstd else None,
            param_names=names,
        )
    else:
        if model is not None:
            print("coatstate: note: the model state dict in SRC is not written to a .pt DST", file=sys.stderr)
        _write_pt(sd, args.dst)
    per_rank = isinstance(ckpt.header.get("per_rank"), dict)  # its rank files count too
    src_size = _file_bytes(args.src, ckpt.header) if per_rank else _size_of(args.src)
    dst_size = _size_of(args.dst)
    print(
        f"{args.src} ({_mb(src_size)}) -> {args.dst} ({_mb(dst_size)}, {dst_size / max(src_size, 1):.3f}x, "
        f"{direction}) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


def _master(args: argparse.Namespace, ckpt, names: dict[int, str]):
    """(model, optimizer state dict) with the master weights as --master-bits asks: joined back
    into float32 first (an existing split, so 32 -> 24 works too; always for --to adamw), then
    split again for 16/24/32."""
    import re

    from coatstate.formats.optimizer_state import MASTER_CORRECTION
    from coatstate.optim.master_convert import join_master, split_master

    sd, model = ckpt.optimizer, ckpt.model
    has_master = any(MASTER_CORRECTION in s for s in sd["state"].values()) or any(
        g.get("master_bits") for g in sd["param_groups"]
    )
    if model is None or not names:
        if args.master_bits is None and not has_master:
            return model, sd
        raise _checkpoint_error(
            f"{args.src} holds no model state dict with parameter names: master weights convert "
            "with their optimizer (save with coatstate.save(optimizer, url, model=model))"
        )
    if has_master:
        model, sd = _converted("join its master weights", args.src, join_master, model, sd, param_names=names)
    if args.master_bits in (None, "none"):
        return model, sd
    pattern = re.compile(args.keep)
    keep = [n for n in names.values() if pattern.search(n)]
    what, bits = "split its master weights", int(args.master_bits)
    return _converted(what, args.src, split_master, model, sd, master_bits=bits, keep=keep, param_names=names)


def _regex(text: str) -> str:
    import re

    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e})") from None
    return text


# -------------------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (subparsers inherit it)."""

    def error(self, message: str):
        print(f"{self.prog}: usage error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}; got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="coatstate",
        description="coatstate checkpoints and memory: `inspect` what a checkpoint holds, `convert` between "
        "torch AdamW and compressed (FP8) optimizer states, `clean` what killed saves left next to a "
        "checkpoint, `plan` a training job's memory per GPU.",
        epilog="Exit codes: 0 ok, 1 a checkpoint problem (one line on stderr), 2 a usage error.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{inspect,convert,clean,plan}")
    i = sub.add_parser(
        "inspect",
        help="what a checkpoint holds (reads the header only unless --verify)",
        description="Describe a coatstate .safetensors checkpoint (or a torch .pt optimizer state dict): "
        "optimizer, step, param groups, per-parameter formats and sizes.",
    )
    i.add_argument("file", help="a .safetensors checkpoint (local path or fsspec URL) or a torch .pt")
    i.add_argument("--verify", action="store_true", help="read every tensor and check its checksum")
    i.add_argument("--json", action="store_true", help="print JSON for scripts")
    i.add_argument("--all", action="store_true", help="list every parameter (default: the first 20)")
    i.set_defaults(run=cmd_inspect)
    c = sub.add_parser(
        "convert",
        help="torch AdamW .pt <-> compressed .safetensors (SRC may be a DCP directory)",
        description="Convert optimizer states: .pt/.pth/.bin -> .safetensors compresses, .safetensors -> "
        ".pt decompresses (torch.optim.AdamW loads the result); a torch.distributed.checkpoint directory "
        "or a .safetensors (per-rank, sharded) converts as it is to one .safetensors file. DST must "
        "differ from SRC.",
    )
    c.add_argument("src", help="a .pt, a .safetensors, or a torch.distributed.checkpoint directory")
    c.add_argument("dst", help="the file to write: .safetensors (coatstate) or .pt/.pth/.bin (torch.save)")
    c.add_argument(
        "--to",
        choices=("compressed", "adamw"),
        help="direction (default: from the extensions; .pt -> .safetensors: compressed)",
    )
    c.add_argument(
        "--group-size", type=_int_at_least(1), default=128, help="elements per FP8 scale group (default 128)"
    )
    c.add_argument(
        "--exp-avg-format",
        choices=("e4m3", "e5m2"),
        default="e4m3",
        help="FP8 format of exp_avg (default e4m3)",
    )
    c.add_argument(
        "--exp-avg-sq-format",
        choices=("e4m3", "e5m2"),
        default="e4m3",
        help="FP8 format of exp_avg_sq (default e4m3)",
    )
    c.add_argument(
        "--expand",
        action="store_true",
        help="COAT's dynamic range expansion on both moments (off by default, as CompressedAdamW's)",
    )
    c.add_argument("--no-expand", action="store_false", dest="expand", help="no expansion (the default)")
    c.add_argument(
        "--min-numel",
        type=_int_at_least(0),
        default=4096,
        help="parameters with fewer elements keep fp32 states (default 4096)",
    )
    c.add_argument("--zstd", action="store_true", help="zstandard-compress the tensors")
    c.add_argument(
        "--master-bits",
        choices=("none", "16", "24", "32"),
        help="bfloat16 weights + master weights of this many bits from SRC's float32 model (32: exact), "
        "or 'none': float32 weights from SRC's masters (needs a model saved with the optimizer)",
    )
    c.add_argument(
        "--keep",
        type=_regex,
        default=r"(^|\.)[^.]*(norm|ln)[^.]*\.",
        help="with --master-bits: parameters whose names match stay float32 (default: norms, as cast_model)",
    )
    c.set_defaults(run=cmd_convert)
    from coatstate.cli.clean import add_clean_parser
    from coatstate.cli.plan import add_plan_parser

    add_clean_parser(sub)
    add_plan_parser(sub)
    return p


def _one_line(e: BaseException, files: list[str]) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if files and not any(f and f in text for f in files):
        text = f"{files[0]}: {text}"
    return text


def _quiet_stdout() -> None:
    """After a closed pipe (`| head`): later writes and the exit flush go nowhere, silently."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage message (or the help)
        return int(e.code or 0)
    files = [
        f for f in (getattr(args, n, None) for n in ("file", "src", "dst", "model")) if isinstance(f, str)
    ]
    # torch's CPU wheel warns on import that numpy is missing; no command here needs numpy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    try:
        code = args.run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader stopped reading: not an error of ours
        _quiet_stdout()
        return 0
    except UsageError as e:
        print(f"coatstate: usage error: {_one_line(e, [])}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, ImportError, TypeError, OSError, RecursionError, MemoryError) as e:
        # CheckpointError is a ValueError
        print(f"coatstate: error: {_one_line(e, files)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - never a traceback; the summary names the error
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(
            f"coatstate: error: {_one_line(e, files)} ({type(e).__name__}; an unexpected error, please "
            f"report it; {DEBUG_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
