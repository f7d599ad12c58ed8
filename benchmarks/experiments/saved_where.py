"""What the FP8 recipe holds at the forward's end, on a GPU: each compiled block's saved tensors
(CompiledActivations.report) and the live allocations grouped by the code that made them.

    python benchmarks/experiments/saved_where.py coatstate_compiled_graphs_rel_b24 [--batch 8]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
import fp8_linear_train as bench  # noqa: E402

from coatstate.models import ModelConfig  # noqa: E402

GIB = 2.0**30


def _where(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python (generated inductor code counts as ours)."""
    for f in frames:
        name = f["filename"]
        if name.endswith(".py") and ("torchinductor" in name or "/torch/" not in name):
            return f"{Path(name).name}:{f['line']} {f['name']}"
    python = [f for f in frames if f["filename"].endswith(".py")]
    return " < ".join(f"{Path(f['filename']).name}:{f['name']}" for f in python)[:300]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("method")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = dataclasses.replace(ModelConfig(**bench.TINYLLAMA, seq=2048), cast_residual=True)
    device = torch.device("cuda")
    model, opt, ctx, notes = bench.build(args.method, cfg, device)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device=device)
    for _ in range(2):
        bench.train_step(model, opt, ctx, idx[:, :-1], idx[:, 1:], device)
    graphs = notes.get("compiled_activations")
    result: dict = {"method": args.method, "batch": args.batch}
    if graphs is not None:
        result["report"] = [(n, list(s), str(d), what) for n, s, d, what in graphs.report]
        print("\n".join(f"{n:14s} {str(s):24s} {d:16s} {w}" for n, s, d, w in result["report"]))
        print(graphs.stats.summary())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    with torch.autocast("cuda", dtype=torch.bfloat16), ctx():
        loss = model(idx[:, :-1], idx[:, 1:])
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    by_site: collections.Counter = collections.Counter()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated" and blk.get("frames"):
                by_site[_where(blk["frames"])] += blk["size"]
    held = torch.cuda.memory_allocated() - base
    print(f"held at forward end above the static state: {held / GIB:.2f} GiB; by allocating site:")
    result["held_gib"] = held / GIB
    result["by_site_gib"] = {k: v / GIB for k, v in by_site.most_common(25)}
    for site, nbytes in by_site.most_common(25):
        print(f"  {nbytes / GIB:7.3f} GiB  {site}")
    loss.backward()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
