"""`coatstate convert SRC DST`: torch AdamW states <-> compressed (FP8) states, between a .pt, a
.safetensors checkpoint (one file, sharded or per-rank) and a torch.distributed.checkpoint
directory; master weights split or joined on the way (--master-bits).

Never writes over its input: DST is refused when it is SRC or a file SRC is read from (a shard,
a rank file, anything inside a DCP directory), on every filesystem; an existing DST is replaced
only with --force.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Any

from coatstate.cli.common import (
    PT_EXTENSIONS,
    ST_EXTENSIONS,
    UsageError,
    checkpoint_error,
    extension,
    human_bytes,
    int_in,
    regex,
    stored_bytes,
)
from coatstate.cli.locations import refuse_input_as_output

MAX_GROUP_SIZE = 2**16
"""formats.defaults.MAX_GROUP_SIZE (not imported: it brings torch, and --help must not)."""
MAX_MIN_NUMEL = 2**63 - 1
"""A tensor's numel is an int64: any larger threshold means the same (nothing compressed)."""


def add_convert_parser(sub) -> None:
    """Register `convert` on the `coatstate` subcommand parser."""
    c = sub.add_parser(
        "convert",
        help="torch AdamW .pt <-> compressed .safetensors (SRC may be a DCP directory)",
        description="Convert optimizer states: .pt/.pth/.bin -> .safetensors compresses, .safetensors -> "
        ".pt decompresses (torch.optim.AdamW loads the result); a torch.distributed.checkpoint directory "
        "or a .safetensors (per-rank, sharded) converts as it is to one .safetensors file. DST is never "
        "SRC or a file SRC is read from, and an existing DST is replaced only with --force. Writes DST "
        "atomically and prints one line on stderr: both files' sizes, their ratio, the direction and "
        "the time taken.",
    )
    c.add_argument("src", help="a .pt, a .safetensors, or a torch.distributed.checkpoint directory")
    c.add_argument("dst", help="the file to write: .safetensors (coatstate) or .pt/.pth/.bin (torch.save)")
    c.add_argument(
        "--to",
        choices=("compressed", "adamw"),
        help="direction (default: from the extensions; .pt -> .safetensors: compressed)",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it exists (never SRC or a file SRC is read from)",
    )
    c.add_argument(
        "--group-size",
        type=int_in(1, MAX_GROUP_SIZE),
        default=128,
        help=f"elements per FP8 scale group, 1 to {MAX_GROUP_SIZE} (default 128)",
    )
    c.add_argument(
        "--exp-avg-format",
        choices=("e4m3", "e5m2", "e2m1"),
        default="e4m3",
        help="format of exp_avg: FP8 e4m3 or e5m2, or 4-bit e2m1 (default e4m3)",
    )
    c.add_argument(
        "--exp-avg-sq-format",
        choices=("e4m3", "e5m2", "ue3m1_sqrt"),
        default="e4m3",
        help="format of exp_avg_sq: FP8 e4m3 or e5m2, or 4-bit ue3m1_sqrt (default e4m3)",
    )
    c.add_argument(
        "--expand",
        action="store_const",
        const=True,
        default=None,
        help="COAT's dynamic range expansion on both moments (CompressedAdamW's default: on)",
    )
    c.add_argument(
        "--no-expand", action="store_const", const=False, dest="expand", help="plain E4M3/E5M2 groups"
    )
    c.add_argument(
        "--min-numel",
        type=int_in(0, MAX_MIN_NUMEL),
        default=4096,
        help="parameters with fewer elements keep fp32 states, 0 to 2**63-1 (default 4096)",
    )
    c.add_argument("--zstd", action="store_true", help="zstandard-compress the tensors")
    c.add_argument(
        "--key",
        help="in a .pt holding a dict ({'model': ..., 'optimizer': ..., 'step': ...}), the entry with the "
        "optimizer state dict (default: the one entry that is one; the model comes from 'model')",
    )
    c.add_argument(
        "--master-bits",
        choices=("none", "16", "24", "32"),
        help="bfloat16 weights + master weights of this many bits from SRC's float32 model (32: exact), "
        "or 'none': float32 weights from SRC's masters (needs a model saved with the optimizer)",
    )
    c.add_argument(
        "--keep",
        type=regex,
        default=r"(^|\.)[^.]*(norm|ln)[^.]*\.",
        help="with --master-bits: parameters whose names match stay float32 (default: norms, as cast_model)",
    )
    c.set_defaults(run=cmd_convert)


def _direction(args: argparse.Namespace) -> str:
    if args.to:
        return args.to
    src, dst = extension(args.src), extension(args.dst)
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


def _converted(what: str, src: str, fn, *args, **kwargs):
    """fn's result; a state it cannot convert is a checkpoint problem of SRC, said in one line."""
    from coatstate.formats.schema import CheckpointError

    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as e:
        raise checkpoint_error(f"{src}: cannot {what} ({type(e).__name__}: {e})") from None


def _size_of(url: str) -> int:
    from coatstate.checkpoint import storage

    fs, path = storage.url_to_fs(url)
    return int(fs.du(path))


def _header(src: str) -> dict[str, Any] | None:
    """SRC's coatstate header (which names its shards or rank files), or None for a .pt file or
    a DCP directory; reads the header only."""
    from coatstate.checkpoint import api as checkpoint
    from coatstate.checkpoint import storage

    if os.path.isdir(src) or extension(src) in PT_EXTENSIONS:
        return None
    if storage.read_bytes(src, length=4) == b"PK\x03\x04":  # a torch.save zip, whatever its name
        return None
    return checkpoint.read_header(src)


def _exists(url: str) -> bool:
    from coatstate.checkpoint import storage

    fs, path = storage.url_to_fs(url)
    if storage.is_local(fs):
        return os.path.lexists(path)  # a dangling symlink too: the write would replace it
    return bool(fs.exists(path))


def cmd_convert(args: argparse.Namespace) -> int:
    from coatstate.checkpoint import api as checkpoint
    from coatstate.formats.optimizer_state import MOMENTS, is_compressed

    direction = _direction(args)
    if args.master_bits not in (None, "none") and (
        direction == "adamw" or extension(args.dst) in PT_EXTENSIONS
    ):
        raise UsageError("--master-bits 16/24/32 writes a bfloat16 model: DST must be a .safetensors file")
    if extension(args.dst) not in PT_EXTENSIONS + ST_EXTENSIONS:
        raise UsageError(f"DST {args.dst!r} must end in one of {PT_EXTENSIONS + ST_EXTENSIONS}")
    refuse_input_as_output(args.src, args.dst, _header(args.src))
    if not args.force and _exists(args.dst):
        raise UsageError(f"DST {args.dst} exists: convert replaces a file only when given --force")
    t0 = time.perf_counter()
    ckpt = checkpoint.read(args.src, key=args.key)
    # again with the header that was read: a save may have replaced SRC in between
    refuse_input_as_output(args.src, args.dst, ckpt.header)
    sd = ckpt.optimizer
    has_codes = any(is_compressed(s, name) for s in sd["state"].values() for name in MOMENTS)
    names = {int(k): v["name"] for k, v in (ckpt.header.get("params") or {}).items() if v.get("name")}
    model = ckpt.model
    if args.master_bits is not None or direction == "adamw":
        model, sd = _master(args, ckpt, names)
    if direction == "keep":
        direction = "compressed" if has_codes else "adamw"
    elif direction == "compressed":
        from coatstate.optim import compress_adamw_state_dict, to_adamw_state_dict

        original = sd  # its master weights, which the float32 moments' layout cannot hold
        if has_codes:  # into other formats (FP8 <-> 4-bit): through float32 moments
            shapes = checkpoint.header_shapes(ckpt.header)
            sd = _converted("decompress its states", args.src, to_adamw_state_dict, sd, shapes)

        options = {
            k: getattr(args, k) for k in ("group_size", "exp_avg_format", "exp_avg_sq_format", "min_numel")
        }
        if args.expand is not None:  # else compress_adamw_state_dict's own default, the optimizer's
            options.update(exp_avg_expand=args.expand, exp_avg_sq_expand=args.expand)
        what = "compress its states (are they torch.optim.AdamW's?)"
        sd = _carry_master(original, _converted(what, args.src, compress_adamw_state_dict, sd, **options))
    elif has_codes:
        from coatstate.optim import to_adamw_state_dict

        sd = _converted(
            "decompress its states", args.src, to_adamw_state_dict, sd, checkpoint.header_shapes(ckpt.header)
        )
    if extension(args.dst) in ST_EXTENSIONS:
        _converted(
            "store its state dict",
            args.src,
            checkpoint.save,
            sd,
            args.dst,
            model=model,
            compress="zstd" if args.zstd else None,
            param_names=names,
            extra=ckpt.extra,  # (the run's other state goes with it)
        )
    else:
        if model is not None:
            print("coatstate: note: the model state dict in SRC is not written to a .pt DST", file=sys.stderr)
        _write_pt(sd, args.dst)
    per_rank = isinstance(ckpt.header.get("per_rank"), dict)  # its rank files count too
    src_size = stored_bytes(args.src, ckpt.header) if per_rank else _size_of(args.src)
    dst_size = _size_of(args.dst)
    ratio, seconds = dst_size / max(src_size, 1), time.perf_counter() - t0
    print(
        f"{args.src} ({human_bytes(src_size)}) -> {args.dst} ({human_bytes(dst_size)}, {ratio:.3f}x, "
        f"{direction}) in {seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


def _carry_master(before: dict, after: dict) -> dict:
    """`after` (moments re-encoded from `before`) with `before`'s master weights: the corrections
    and each group's master_bits / master_seed. The re-encoding goes through torch AdamW's layout,
    which has no master; without this a converted 24-bit master would silently become none."""
    from coatstate.formats.optimizer_state import MASTER_CORRECTION

    for old, new in zip(before["param_groups"], after["param_groups"], strict=True):
        for key in ("master_bits", "master_seed"):
            if key in old:
                new[key] = old[key]
    for pid, state in before["state"].items():
        if MASTER_CORRECTION in state and pid in after["state"]:
            after["state"][pid][MASTER_CORRECTION] = state[MASTER_CORRECTION]
    return after


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
        raise checkpoint_error(
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
