"""python benchmarks/experiments/fp8_width.py          (CUDA, compute capability >= 8.9; `--smoke` on CPU)

From which width on does FP8Linear pay? Issue #34 measured the full recipe at 0.81x of AdamW's
tokens/s in the 100M-parameter parity runs (width 768) and 1.45x on the 1B Llama (width 2048).
This times one transformer MLP, Linear(d, 4d) -> GELU -> Linear(4d, d), forward and backward
under bfloat16 autocast with float32 weights, as nn.Linear and as coatstate.nn.FP8Linear (the
same module converted by convert_to_fp8), per width d, at --tokens tokens (the parity runs'
batch: 32 x 1024). Both are torch.compile'd with inductor's defaults (the README's recipe: FP8's
amax, scale and casts fuse into neighbouring kernels there), or run eagerly with --eager.

Every (width, variant) is timed in the same interleaved rounds (benchmarks/rounds.py): the
median over rounds with its min-max, and per width the paired ratio bf16 / FP8 (above 1: FP8 is
faster). Beside each time the compute floor: the MLP's 12 * tokens * d * 4d GEMM FLOPs at the
matmul rate measured in the same run (one large bf16 GEMM and one large FP8 _scaled_mm). The
smallest width from which FP8 is faster at every larger width is printed and written as
`fp8_pays_from_width` (None where it never pays). Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import result_meta  # noqa: E402
from rounds import Variant, paired, run_rounds  # noqa: E402

import coatstate  # noqa: E402


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x), approximate="tanh"))


def matmul_tflops(device: torch.device, fp8: bool, n: int = 8192, reps: int = 20) -> float | None:
    """The matmul rate this GPU reaches on one large square GEMM (bf16, or FP8 via _scaled_mm)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        run = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        run = lambda: a @ b
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def make_variant(d: int, fp8: bool, args, device: torch.device) -> Variant:
    torch.manual_seed(d)
    mlp = MLP(d).to(device)
    if fp8:
        coatstate.convert_to_fp8(mlp, min_features=None)
    run = mlp if args.eager else torch.compile(mlp)
    xs = [torch.randn(args.tokens, d, device=device, requires_grad=True) for _ in range(2)]

    def step(i: int) -> None:
        with torch.autocast(device.type, torch.bfloat16):
            out = run(xs[i % 2])
        out.float().square().mean().backward()

    return Variant(f"{'fp8' if fp8 else 'bf16'} d={d}", step)


def ratio_spread(result: dict, d: int) -> dict | None:
    """bf16 / fp8 wall time, paired per round (rounds.paired): median and min-max."""
    if f"bf16 d={d}" not in result or f"fp8 d={d}" not in result:
        return None
    return paired(result, f"bf16 d={d}", f"fp8 d={d}")


def pays_from(widths: list[int], ratios: dict[int, dict | None]) -> int | None:
    """The smallest width from which FP8 is faster (median ratio > 1) at it and every wider one."""
    best = None
    for d in sorted(widths, reverse=True):
        r = ratios.get(d)
        if r is None or r["median"] <= 1.0:
            break
        best = d
    return best


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="512,768,1024,1536,2048,3072,4096")
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on CPU, emulated FP8, eager")
    ap.add_argument("--out", default="benchmarks/experiments/results/fp8_width.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.widths, args.tokens, args.rounds, args.steps, args.warmup = "64,128", 256, 2, 2, 1
        args.eager, args.device = True, "cpu"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    widths = [int(w) for w in args.widths.split(",")]
    peaks = {"bf16": matmul_tflops(device, False), "fp8": matmul_tflops(device, True)}
    variants = [make_variant(d, fp8, args, device) for d in widths for fp8 in (False, True)]
    t0 = time.monotonic()
    errors: dict = {}
    result = run_rounds(variants, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                        cuda=device.type == "cuda", errors=errors)  # fmt: skip
    rows, ratios = [], {}
    for d in widths:
        ratios[d] = ratio_spread(result, d)
        for kind in ("bf16", "fp8"):
            r = result.get(f"{kind} d={d}")
            flops = 12 * args.tokens * d * 4 * d  # fwd 2 GEMMs, bwd 4: 6 GEMMs of 2*T*d*4d
            floor = None if peaks[kind] is None else flops / (peaks[kind] * 1e12) * 1e3
            wall, error = (r["wall_ms"] if r else None), errors.get(f"{kind} d={d}")
            rows.append({"width": d, "variant": kind, "gemm_flops": flops, "floor_ms": floor,
                         "wall_ms": wall, "error": error})  # fmt: skip
    pays = pays_from(widths, ratios)
    mode, rate = "eager" if args.eager else "compiled", lambda k: f"{peaks[k] or 0:.0f}"
    print(f"\nMLP d -> 4d -> d, {args.tokens} tokens, fwd+bwd, {mode}; "
          f"matmul peaks measured: bf16 {rate('bf16')}, fp8 {rate('fp8')} TFLOP/s")  # fmt: skip
    print(f"{'width':>6} {'bf16 ms [min-max]':>24} {'fp8 ms [min-max]':>24} {'floor bf16/fp8':>16} "
          f"{'bf16/fp8 [min-max]':>22}")  # fmt: skip
    for d in widths:
        cell = {}
        for row in (r for r in rows if r["width"] == d):
            w = row["wall_ms"]
            cell[row["variant"]] = f"{w['median']:.3f} [{w['min']:.3f}-{w['max']:.3f}]" if w else "failed"
            cell[row["variant"] + "_floor"] = f"{row['floor_ms']:.3f}" if row["floor_ms"] else "-"
        r = ratios[d]
        ratio = f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"
        floors = f"{cell['bf16_floor']}/{cell['fp8_floor']}"
        print(f"{d:>6} {cell['bf16']:>24} {cell['fp8']:>24} {floors:>16} {ratio:>22}")
    print(f"FP8Linear pays from width: {pays}  ({time.monotonic() - t0:.0f} s)")
    data = {"meta": result_meta(args) | {"rounds": args.rounds, "steps": args.steps},
            "matmul_tflops": peaks, "rows": rows, "ratios": {str(d): r for d, r in ratios.items()},
            "fp8_pays_from_width": pays, "variants": result}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
