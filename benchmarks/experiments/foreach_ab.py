"""Does stepping the float32-moment parameters together (coatstate.optim.foreach_step) shorten
CompressedAdamW's CPU step? The same optimizer with and without the batch, interleaved.

    python benchmarks/experiments/foreach_ab.py --threads 2 1 --out /tmp/foreach_ab.json

optimizer_cpu.py's GPT-shaped set (384 wide, 8 layers: 100 tensors, 66 of them 1-D), plain E4M3,
the defaults and compress=False; "per-parameter" patches `batchable` to refuse every parameter,
which is the step before the batch existed. Each variant steps 3 times a turn, order alternating
per round.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
from common import gpt_shapes  # noqa: E402
from helpers import ab_arguments, interleaved_step_ms, optimizers_on_copies, ratio_range  # noqa: E402

from coatstate.optim import adamw  # noqa: E402

FORMATS = {
    "defaults": {},
    "plain E4M3": dict(exp_avg_expand=False, exp_avg_sq_expand=False),
    "compress=False": dict(compress=False),
}


def main() -> None:
    args = ab_arguments(__doc__)
    batchable = adamw.batchable
    variants = {"per-parameter": lambda *a, **k: False, "batched": batchable}
    shapes = gpt_shapes(d=384, layers=8)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    n = sum(x.numel() for x in start)
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, options in FORMATS.items():
            opts = optimizers_on_copies(variants, start, grads, **options)
            use = lambda label: setattr(adamw, "batchable", variants[label])  # noqa: E731
            ms = interleaved_step_ms(opts, use, args.rounds)
            adamw.batchable = batchable
            ratio = ratio_range(ms["per-parameter"], ms["batched"])
            results[f"{threads} threads, {name}"] = dict(ms=ms, batched_over_per_parameter=ratio)
            cells = [f"{k} {statistics.median(v):.1f} ms [{min(v):.1f}-{max(v):.1f}]" for k, v in ms.items()]
            print(f"{threads} thread(s) {name:11s} " + "  ".join(cells), end="")
            print(f"  batched/per-parameter {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]")
    if args.out:
        record = dict(params=n, tensors=len(shapes), rounds=args.rounds, results=results)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
