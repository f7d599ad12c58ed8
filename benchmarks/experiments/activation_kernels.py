"""Bandwidth of the activation pack/unpack kernels on big tensors, beside a copy, and their host cost.

    python benchmarks/experiments/activation_kernels.py        # needs a GPU; ~15 s

What compress_activations' GPU path launches per saved tensor (kernels/activation.py): the per-group
pack (codes + scale bytes, one pass) and its unpack, timed with CUDA events (median of 40 calls)
on (tokens, width) bf16 tensors of the sizes a transformer saves, against x.clone() on the same
tensor. Floor bytes = what a pack or unpack must move: 2 bytes read (written) per element, 1 byte
written (read) and one scale byte per group of 16. Also unpack written two other ways (1-D blocks
with the scale gathered per element; the kernel's [groups, 16] tile) at several block sizes and
warp counts, with and without the integer rounding to bfloat16 the kernel does for Triton's
interpreter, each checked bit for bit against the kernel's output: whether the kernel's layout
leaves bandwidth on the table. Last, host microseconds per call on a small tensor (launch cost),
beside x.clone() and an empty allocation. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from coatstate.formats.fp8 import FP8Format
from coatstate.kernels import activation as K
from coatstate.kernels.activation import _decode  # (the kernel's own decode: rewrites differ in layout only)
from coatstate.kernels.fp8_triton import from_fp8_bits

HERE = Path(__file__).resolve().parent
_BF16_MAX = tl.constexpr(3.3895313892515355e38)  # (a global a kernel reads must be a constexpr)


def bench(fn, reps=40):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


@triton.jit
def unpack_1d(buf_ptr, out_ptr, n, G: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    """The unpack with 1-D blocks: each element gathers its group's scale byte."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    q = from_fp8_bits(tl.load(buf_ptr + offs, mask=m, other=0), True)
    x = _decode(q, tl.load(buf_ptr + n + offs // G, mask=m, other=0), _BF16_MAX, ROUND)
    tl.store(out_ptr + offs, x.to(tl.bfloat16), mask=m)


@triton.jit
def unpack_2d(buf_ptr, out_ptr, n, n_groups, G: tl.constexpr, BG: tl.constexpr, ROUND: tl.constexpr):
    """The unpack's own [groups, G] tile, at other block sizes and warps."""
    gid = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    offs = gid[:, None] * G + tl.arange(0, G)[None, :]
    offs = tl.max_contiguous(tl.multiple_of(offs, [G, G]), [1, G])
    m = (gid < n_groups)[:, None]
    q = from_fp8_bits(tl.load(buf_ptr + offs, mask=m, other=0), True)
    byte = tl.load(buf_ptr + n + gid, mask=gid < n_groups, other=0)[:, None]
    tl.store(out_ptr + offs, _decode(q, byte, _BF16_MAX, ROUND).to(tl.bfloat16), mask=m)


def _row(name: str, ms: float, moved: float, ok=None) -> dict:
    row = {"kernel": name, "us": ms * 1e3, "tb_per_s": moved / ms / 1e9}
    if ok is not None:
        row["bit_exact"] = ok
    print(
        f"  {name:<44} {row['us']:8.1f} us  {row['tb_per_s']:5.2f} TB/s" + ("" if ok is None else f"  {ok}")
    )
    return row


def _unpack_launch(kind: str, buf, out, n: int, block: int, warps: int, fast: bool):
    rnd = not fast  # (fast: the GPU's own cast to bfloat16 instead of the interpreter's rounding)
    if kind == "1d":
        grid = (triton.cdiv(n, block),)
        return lambda: unpack_1d[grid](buf, out, n, G=16, BLOCK=block, ROUND=rnd, num_warps=warps)
    grid = (triton.cdiv(n // 16, block // 16),)
    return lambda: unpack_2d[grid](buf, out, n, n // 16, G=16, BG=block // 16, ROUND=rnd, num_warps=warps)


def _variants(buf, out, ref, n: int, moved: float) -> list[dict]:
    rows = []
    for fast in (False, True):
        for block, warps in ((4096, 8), (4096, 4), (8192, 8), (2048, 4), (1024, 4)):
            for kind in ("1d", "2d"):
                t = bench(_unpack_launch(kind, buf, out, n, block, warps, fast))
                ok = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                name = f"unpack {kind} block {block} warps {warps}{' cast' if fast else ''}"
                rows.append(_row(name, t, moved, ok) | {"layout": kind, "block": block, "warps": warps})
    return rows


def _host_costs() -> list[dict]:
    fmt = FP8Format.E4M3
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    buf = K.pack_groups_flat(x, n, 256, 16, fmt)
    calls = {
        "pack_groups_flat": lambda: K.pack_groups_flat(x, n, 256, 16, fmt),
        "unpack_groups_flat": lambda: K.unpack_groups_flat(buf, n, 256, 16, fmt, torch.bfloat16),
        "x.clone()": lambda: x.clone(),
        "torch.empty": lambda: x.new_empty(n, dtype=torch.uint8),
    }
    rows = []
    for name, fn in calls.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            per.append((time.perf_counter() - t0) / 500 * 1e6)
            torch.cuda.synchronize()
        rows.append({"call": name, "host_us": statistics.median(per), "min": min(per), "max": max(per)})
        print(f"  host per call {name:22s} {statistics.median(per):6.1f} us [{min(per):.1f}-{max(per):.1f}]")
    return rows


def _shape(rows: int, cols: int) -> dict:
    fmt = FP8Format.E4M3
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    moved = (2 + 1 + 1 / 16) * n
    buf = K.pack_groups_flat(x, n, cols, 16, fmt)
    ref = K.unpack_groups_flat(buf, n, cols, 16, fmt, torch.bfloat16)
    out = torch.empty_like(ref)
    print(f"\n{rows}x{cols} bf16 ({n / 1e6:.1f}M elements); floor bytes {moved / 1e6:.0f} MB each way")
    kernels = [
        _row("clone (2+2 B/elem)", bench(x.clone), 4 * n),
        _row("pack_groups_flat", bench(lambda: K.pack_groups_flat(x, n, cols, 16, fmt)), moved),
        _row("unpack_groups_flat", bench(lambda: K.unpack_groups_flat(buf, n, cols, 16, fmt, x.dtype)),
             moved),
    ]  # fmt: skip
    kernels += _variants(buf, out, ref, n, moved)
    return {"rows": rows, "cols": cols, "floor_bytes": moved, "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(HERE / "results" / "activation_kernels.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("activation_kernels.py times CUDA kernels: it needs a GPU")
    shapes = [_shape(rows, cols) for rows, cols in ((16384, 2048), (16384, 5632), (8192, 1024))]
    from common import result_meta

    record = {"meta": result_meta(device="cuda"), "shapes": shapes, "host": _host_costs()}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main()
