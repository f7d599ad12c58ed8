"""`coatstate plan`: the argument parser and the command (the work is in coatstate.planner).

Kept apart from coatstate.planner so that building the `coatstate` parser never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import stat

from coatstate.cli.common import in_range, int_in
from coatstate.planner.units import RANGES, parse_bytes, parse_count

MAX_CONFIG_BYTES = 64 * 2**20
"""A model config is a few kB; anything this large is not one."""
MAX_CONFIG_DEPTH = 64
"""Nesting a config may have (transformers' are a few levels deep)."""


def _int(name: str):
    return int_in(*RANGES[name])


def _span(name: str) -> str:
    low, high = RANGES[name]
    return f"{low:,} to {high:,}"


def add_plan_parser(sub) -> None:
    """Register `plan` on the `coatstate` subcommand parser."""
    p = sub.add_parser(
        "plan",
        help="memory per GPU, GPUs needed and largest micro-batch: torch AdamW vs CompressedAdamW",
        description="Predict training memory per GPU for torch AdamW, CompressedAdamW, CompressedAdamW "
        "+ compress_activations (also with gradient release, and with FP8 linear layers when "
        "coatstate.nn has them), from the model's real parameter shapes and a short CPU trace of its "
        "activations (docs/planner.md). Prints a verdict line first (the GPUs torch AdamW needs "
        "against coatstate's), the job, then one row per way of training: GB per GPU of params, "
        "grads, master weights, optimizer states, saved activations, the step's transient memory and "
        "the peak, the share of --gpu-memory left free, the fewest GPUs that hold it and the largest "
        "micro-batch that fits; advice when nothing fits (--json: the same as one JSON object).",
    )
    p.add_argument(
        "model",
        nargs="?",
        help="a config JSON file (GPT-2 or Llama keys), a transformers config name (needs "
        "transformers), or module:factory (a function returning an nn.Module); omit it to describe "
        "the model with --params/--layers/--hidden",
    )
    m = p.add_argument_group("model from numbers")
    m.add_argument("--arch", choices=("llama", "gpt"), default="llama", help="block layout (default llama)")
    m.add_argument(
        "--params",
        type=in_range(parse_count, *RANGES["params"], "--params"),
        help=f"total parameters, e.g. 7B: alone, the published shape nearest to it (Llama-2-7B); "
        f"with --layers and --hidden, the vocabulary takes the rest ({_span('params')})",
    )
    m.add_argument(
        "--layers",
        type=_int("layers"),
        help=f"transformer blocks (with --hidden: the model from numbers; {_span('layers')})",
    )
    m.add_argument("--hidden", type=_int("hidden"), help=f"model width (hidden size; {_span('hidden')})")
    m.add_argument(
        "--heads",
        type=_int("heads"),
        help=f"attention heads (default hidden / 128, at least 1; {_span('heads')})",
    )
    m.add_argument(
        "--kv-heads",
        type=_int("kv_heads"),
        help=f"key/value heads for grouped-query attention (llama; {_span('kv_heads')})",
    )
    m.add_argument(
        "--ffn",
        type=_int("ffn"),
        help=f"MLP width (default: llama 8/3 hidden rounded to 256, gpt 4x; {_span('ffn')})",
    )
    m.add_argument(
        "--vocab",
        type=_int("vocab"),
        help=f"vocabulary size (default: from --params, else 32000; {_span('vocab')})",
    )
    j = p.add_argument_group("job")
    j.add_argument(
        "--seq",
        type=_int("seq"),
        help=f"sequence length (default: the config's maximum, else 2048; {_span('seq')})",
    )
    j.add_argument(
        "--batch", type=_int("batch"), default=1, help=f"micro-batch per GPU (default 1; {_span('batch')})"
    )
    j.add_argument("--gpus", type=_int("gpus"), default=1, help=f"GPUs (default 1; {_span('gpus')})")
    j.add_argument(
        "--sharding",
        choices=("none", "fsdp2"),
        default="none",
        help="none: every GPU holds everything; fsdp2: params, grads, master weights and "
        "optimizer states sharded over --gpus",
    )
    j.add_argument(
        "--gpu-memory",
        type=in_range(parse_bytes, *RANGES["gpu_memory"], "--gpu-memory"),
        default=parse_bytes("80GB"),
        help="memory per GPU (default 80GB; 1 byte to 1 PiB)",
    )
    j.add_argument(
        "--param-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16: bf16 params and grads, with master weights (torch AdamW: an fp32 copy; "
        "CompressedAdamW: its default master_bits=24 correction); fp32: fp32 params and grads with "
        "bf16 autocast (default bf16)",
    )
    j.add_argument(
        "--no-master-weights",
        action="store_true",
        help="bf16 params without master weights (no fp32 copy; CompressedAdamW master_bits=None)",
    )
    j.add_argument("--no-autocast", action="store_true", help="with --param-dtype fp32: run in fp32")
    j.add_argument(
        "--loss-chunks",
        type=_int("loss_chunks"),
        default=1,
        help=f"head + loss over this many checkpointed chunks of tokens (built models only; "
        f"{_span('loss_chunks')})",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(run=cmd_plan)


def _depth(value) -> int:
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d + 1)
            if deepest > MAX_CONFIG_DEPTH:
                break
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_config(path: str) -> dict:
    """A JSON config file as a dict; ValueError naming the file for anything else (a FIFO, a
    device, a huge or deeply nested file, a JSON list)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ValueError(f"{path}: cannot open the config ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file; give a JSON config file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path}: {st.st_size:,} bytes is too large for a model config")
        raw = os.read(fd, st.st_size)
    finally:
        os.close(fd)
    try:
        cfg = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a model config") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path} is not a readable JSON config: {e}") from None
    if _depth(cfg) > MAX_CONFIG_DEPTH:
        raise ValueError(f"{path}: JSON nested deeper than {MAX_CONFIG_DEPTH} levels is not a model config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a model config is a JSON object; this file holds a {type(cfg).__name__}")
    return cfg


CONFIG_RANGES = {"layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads",
                 "ffn": "ffn", "vocab": "vocab", "max_seq": "seq"}  # fmt: skip
"""Each field of a config's shape, and the option whose range bounds it."""


def check_config_ranges(shape, path: str) -> None:
    """A config's numbers within the ranges the options have: a config with n_layer 1e8 is
    refused at once, as `--layers 100000000` is, not built and traced for minutes."""
    for field, option in CONFIG_RANGES.items():
        low, high = RANGES[option]
        value = getattr(shape, field)
        if not low <= value <= high:
            raise ValueError(
                f"{path}: {field} {value:,} is outside what `plan` takes ({low:,} to {high:,}, as "
                f"--{option.replace('_', '-')})"
            )


def cmd_plan(args: argparse.Namespace) -> int:
    from coatstate import planner

    if args.model is None and not (args.layers or args.hidden or args.params):
        raise ValueError(
            "give a model: a config JSON file, a transformers config name, module:factory, "
            "--params alone (e.g. --params 7B: the published shape nearest to it), or the numbers "
            "--layers and --hidden (with --params or --vocab)"
        )
    model = args.model
    if model is not None and (os.path.lexists(model) and not os.path.isdir(model)):
        from coatstate.planner.models import shape_from_config
        from coatstate.planner.planning import spec_from_shape

        cfg = read_config(model)
        try:
            shape = shape_from_config(cfg, loss_chunks=args.loss_chunks)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{model}: not a usable model config ({type(e).__name__}: {e})") from None
        check_config_ranges(shape, model)
        model = spec_from_shape(shape, os.path.basename(model))
    shape = {
        k: getattr(args, k)
        for k in ("arch", "params", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
    }
    # (a model built from numbers takes any length)
    spec = planner.resolve_model(model, max_seq=args.seq or 2048, loss_chunks=args.loss_chunks, **shape)
    setup = {k: getattr(args, k) for k in ("seq", "batch", "gpus", "sharding", "gpu_memory", "param_dtype")}
    master = None if not args.no_master_weights else False
    result = planner.plan(spec, master_weights=master, autocast=not args.no_autocast, **setup)
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    return 0
