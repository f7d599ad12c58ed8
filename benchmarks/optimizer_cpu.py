"""python benchmarks/optimizer_cpu.py

CPU step time of coatstate.CompressedAdamW (its pure-torch step, coatstate/optim/reference_step.py) against
torch.optim.AdamW(foreach=True) and AdamW(foreach=False), on a GPT-shaped set of fp32 parameters
(default 51.5M: vocab 50304, width 512, 8 layers, as benchmarks/common.py's gpt_shapes builds them) with
random fp32 gradients. Median of --steps timed steps after --warmup. A last row times
CompressedAdamW with its step on whole tensors instead of row blocks (what the blocks buy).
Prints a table and writes benchmarks/results/optimizer_cpu.json.

    python benchmarks/optimizer_cpu.py --dim 128 --layers 1 --steps 2 --out /tmp/cpu.json   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import coatstate
from coatstate.optim import reference_step as adamw_twin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import gpt_shapes, result_meta  # noqa: E402

WHOLE = "coatstate CompressedAdamW (expansion on), whole-tensor twin"
"""The CPU step as it was before it worked in cache-sized row blocks (coatstate/optim/reference_step.py)."""

OPTIMIZERS = {
    "torch AdamW foreach=True": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "torch AdamW foreach=False": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "coatstate CompressedAdamW (expansion on)": lambda ps: coatstate.CompressedAdamW(
        ps, lr=1e-3, exp_avg_expand=True, exp_avg_sq_expand=True
    ),
    "coatstate CompressedAdamW (expansion off)": lambda ps: coatstate.CompressedAdamW(
        ps, lr=1e-3, exp_avg_expand=False, exp_avg_sq_expand=False
    ),
    WHOLE: lambda ps: coatstate.CompressedAdamW(ps, lr=1e-3, exp_avg_expand=True, exp_avg_sq_expand=True),
}
REFERENCE = "torch AdamW foreach=True"


def time_optimizer(make, shapes, steps: int, warmup: int) -> dict:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 1e-3 for s in shapes] for _ in range(2)]  # two sets, alternated
    opt = make(params)
    times = []
    for i in range(warmup + steps):
        for p, gr in zip(params, grads[i % 2], strict=True):
            p.grad = gr
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in params)
    timed = times[warmup:]
    return {
        "state_bytes": coatstate.optim.optimizer_state_bytes(opt),
        "state_bytes_per_param": coatstate.optim.optimizer_state_bytes(opt) / n,
        "step_ms": 1e3 * statistics.median(timed),
        "step_ms_min": 1e3 * min(timed),
        "first_step_ms": 1e3 * times[0],
        "ns_per_param": 1e9 * statistics.median(timed) / n,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "optimizer_cpu.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = gpt_shapes(d=args.dim, layers=args.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    meta = result_meta(args, device="cpu") | {"threads": torch.get_num_threads()}
    print(f"{n / 1e6:.1f}M params in {len(shapes)} tensors; {meta['machine']}, {meta['threads']} threads")

    rows = []
    for name, make in OPTIMIZERS.items():
        block = adamw_twin.ROW_BLOCK_ELEMENTS
        if name == WHOLE:
            adamw_twin.ROW_BLOCK_ELEMENTS = 2**62  # every tensor in one piece
        try:
            r = {"name": name} | time_optimizer(make, shapes, args.steps, args.warmup)
        finally:
            adamw_twin.ROW_BLOCK_ELEMENTS = block
        rows.append(r)
        print(f"  {name}: {r['step_ms']:.0f} ms", flush=True)
    ref = next(r["step_ms"] for r in rows if r["name"] == REFERENCE)
    report = {
        "meta": meta,
        "params": n,
        "tensors": len(shapes),
        "steps": args.steps,
        "warmup": args.warmup,
        "reference": REFERENCE,
        "reference_ms": ref,
        "rows": rows,
    }

    print(f"\n{'optimizer':<62}{'state B/param':>14}{'step ms':>10}{'ns/param':>10}{'vs foreach':>11}")
    for r in rows:
        print(
            f"{r['name']:<62}{r['state_bytes_per_param']:>14.3f}{r['step_ms']:>10.0f}{r['ns_per_param']:>10.2f}"
            f"{r['step_ms'] / ref:>10.2f}x"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
