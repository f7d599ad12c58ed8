"""Does running a param group's CPU steps in one call (kernels/cpu_step.run: one parallel region
over all their groups) shorten CompressedAdamW's step? The same optimizer with and without it,
interleaved. It did not, and was reverted: this runs on that commit's tree only.

    git checkout 0d84935 -- kernels coatstate   # the batched step (reverted by the next commit)
    python benchmarks/experiments/cpu_batch_ab.py --threads 2 1 --out /tmp/cpu_batch_ab.json

"per-tensor" patches `cpu_step.run` to make one library call per tensor, each with its own
parallel region and thread count (a tensor under 32,768 elements on one thread): the step before
the batch existed. Two sets: 100 tensors of 64 x 64 (a model of small tensors, where it matters)
and optimizer_cpu.py's GPT-shaped set (34M parameters). Plain E4M3 and the defaults; each variant
steps 3 times a turn, order alternating per round; ms = median over rounds [min-max] of each
turn's median step.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
from coatstate.kernels import cpu_step  # noqa: E402
from common import gpt_shapes  # noqa: E402
from helpers import ab_arguments, interleaved_step_ms, optimizers_on_copies, ratio_range  # noqa: E402

FORMATS = {
    "defaults": {},
    "plain E4M3": dict(exp_avg_expand=False, exp_avg_sq_expand=False),
}
SETS = {
    "100 x (64, 64)": [(64, 64)] * 100,
    "GPT-shaped 34M": gpt_shapes(d=384, layers=8),
}


def per_tensor(steps, threads=None):
    """cpu_step.run as it was: one call (one parallel region) per tensor."""
    lib, _ = cpu_step.library()
    for s in steps:
        lib.coat_adamw_step(ctypes.byref(s))
    return [int(s.nonfinite) for s in steps]


def main() -> None:
    args = ab_arguments(__doc__)
    if not hasattr(cpu_step, "run"):
        raise SystemExit("needs commit 0d84935's batched CPU step: git checkout 0d84935 -- kernels coatstate")
    variants = {"per-tensor": per_tensor, "batched": cpu_step.run}
    results = {}
    for set_name, shapes in SETS.items():
        gen = torch.Generator().manual_seed(0)
        start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
        grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, options in FORMATS.items():
                opts = optimizers_on_copies(variants, start, grads, min_numel=1, **options)
                use = lambda label: setattr(cpu_step, "run", variants[label])  # noqa: E731
                ms = interleaved_step_ms(opts, use, args.rounds)
                cpu_step.run = variants["batched"]
                ratio = ratio_range(ms["per-tensor"], ms["batched"])
                key = f"{set_name}, {threads} threads, {name}"
                results[key] = dict(ms=ms, batched_over_per_tensor=ratio)
                cells = [
                    f"{k} {statistics.median(v):.2f} ms [{min(v):.2f}-{max(v):.2f}]" for k, v in ms.items()
                ]
                print(f"{key:40s} " + "  ".join(cells), end="")
                print(f"  batched/per-tensor {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]")
    if args.out:
        record = dict(rounds=args.rounds, torch=torch.__version__, results=results)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
