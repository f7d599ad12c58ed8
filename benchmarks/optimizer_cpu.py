"""python benchmarks/optimizer_cpu.py

CPU step time of coatstate.CompressedAdamW (its C++ step, kernels/cpu_step.cpp) beside torch's
AdamW (fused, foreach) on common.gpt_shapes' fp32 parameters with random gradients, all in memory at
once and taking turns in rounds whose order rotates: per variant ns per parameter (median [min-max]
over rounds), the ratio to torch fused, the bytes-moved floor at this machine's in-place bandwidth, and
the first step of a fresh process (inductor's cache cold and warm). Prints docs/benchmarks.md's
table; writes benchmarks/results/optimizer_cpu.json.

    python benchmarks/optimizer_cpu.py --dim 64 --layers 1 --rounds 2 --threads 1 --out /tmp/cpu.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import gpt_shapes, median_range, result_meta

from coatstate import CompressedAdamW
from coatstate.optim import optimizer_state_bytes

ROOT = Path(__file__).resolve().parent.parent

FOURBIT = dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt")
PLAIN = dict(exp_avg_expand=False, exp_avg_sq_expand=False)
# name: (make optimizer, parameter dtype, bytes a step reads and writes per parameter)
VARIANTS = {
    "torch AdamW fused=True": (lambda ps: torch.optim.AdamW(ps, fused=True), torch.float32, 28.0),
    "torch AdamW foreach=True": (lambda ps: torch.optim.AdamW(ps, foreach=True), torch.float32, 28.0),
    "coatstate defaults (FP8, expansion)": (lambda ps: CompressedAdamW(ps), torch.float32, 16.16),
    "coatstate plain E4M3": (lambda ps: CompressedAdamW(ps, **PLAIN), torch.float32, 16.13),
    "coatstate 4-bit (e2m1 / ue3m1_sqrt)": (lambda ps: CompressedAdamW(ps, **FOURBIT), torch.float32, 14.13),
    "coatstate bf16 params, 24-bit master": (lambda ps: CompressedAdamW(ps), torch.bfloat16, 12.16),
    "coatstate compress=False": (lambda ps: CompressedAdamW(ps, compress=False), torch.float32, 28.0),
    # the oracle, timed with --twin: what the CPU step was before the C++ one
    (TWIN := "coatstate defaults, pure-torch twin (fused=False)"): (
        lambda ps: CompressedAdamW(ps, fused=False), torch.float32, 16.16),
}  # fmt: skip
REFERENCE = "torch AdamW fused=True"


def inplace_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second that an in-place Tensor.add_ reads plus writes. In place, as the optimizer
    step is: an out-of-place copy also reads its destination (write-allocate) and under-counts."""
    torch.set_num_threads(threads)
    x = torch.rand(mib * 2**18)
    x.add_(1.0)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.add_(1.0)
        times.append(time.perf_counter() - t)
    return 2 * x.numel() * 4 / statistics.median(times)


class Variant:
    def __init__(self, name, make, dtype, shapes, grads):
        gen = torch.Generator().manual_seed(0)
        self.name = name
        self.params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype)) for s in shapes]
        self.grads = [[g.to(dtype) for g in gs] for gs in grads]
        self.opt = make(self.params)
        self.times: list[float] = []

    def run(self, steps: int, step_index: int) -> float:
        """Median seconds of `steps` steps, gradients alternating between two sets."""
        times = []
        for i in range(steps):
            for p, g in zip(self.params, self.grads[(step_index + i) % 2], strict=True):
                p.grad = g
            t = time.perf_counter()
            self.opt.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def time_variants(names, shapes, threads: int, rounds: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(2)]
    variants = []
    for name in names:
        make, dtype, _ = VARIANTS[name]
        v = Variant(name, make, dtype, shapes, grads)
        v.run(1, 0)  # warm-up: states created, the CPU step built and loaded
        variants.append(v)
    per_round = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            per_round[v.name].append(v.run(steps, r))
    n = sum(p.numel() for p in variants[0].params)
    out = {}
    for v in variants:
        out[v.name] = {
            "step_ms": median_range([1e3 * t for t in per_round[v.name]]),
            "ns_per_param": median_range([1e9 * t / n for t in per_round[v.name]]),
            "state_bytes_per_param": optimizer_state_bytes(v.opt) / n,
        }
    return out


_FIRST_STEP = """
import time, torch, coatstate
torch.set_num_threads({threads})
ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in {shapes!r}]
for p in ps:
    p.grad = torch.randn_like(p) * 1e-3
opt = coatstate.CompressedAdamW(ps)
t = time.perf_counter()
opt.step()
print(time.perf_counter() - t)
"""


def first_step_seconds(shapes, threads: int) -> dict:
    """A fresh process's first CompressedAdamW step: with an empty cache directory (the kernel is
    compiled), then again with that directory warm."""
    code = _FIRST_STEP.format(threads=threads, shapes=[tuple(s) for s in shapes])
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for label in ("cold", "warm"):
            res = subprocess.check_output([sys.executable, "-c", code], env=env, text=True)
            out[label] = float(res.split()[-1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--twin", action="store_true", help="also time the pure-torch twin (slow)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "optimizer_cpu.json"))
    args = ap.parse_args(argv)
    shapes = gpt_shapes(d=args.dim, layers=args.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    names = [name for name in VARIANTS if args.twin or name != TWIN]
    meta = result_meta(args, device="cpu")
    print(f"{n / 1e6:.1f}M params in {len(shapes)} tensors; {meta['machine']}")
    report = {"meta": meta, "params": n, "tensors": len(shapes), "reference": REFERENCE, "by_threads": {}}
    for threads in args.threads:
        bandwidth = inplace_bandwidth(threads)
        rows = time_variants(names, shapes, threads, args.rounds, args.steps)
        ref = rows[REFERENCE]["ns_per_param"]["median"]
        for name, r in rows.items():
            r["bytes_moved_per_param"] = moved = VARIANTS[name][2]
            r["floor_ns_per_param"] = 1e9 * moved / bandwidth
            r["vs_reference"] = r["ns_per_param"]["median"] / ref
        first = first_step_seconds(shapes, threads)
        report["by_threads"][str(threads)] = {
            "inplace_bandwidth_bytes_per_s": bandwidth,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "rows": rows,
            "first_step_s": first,
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    from report import section_optimizer_cpu  # the table docs/benchmarks.md shows

    print(section_optimizer_cpu(report, out) + f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
