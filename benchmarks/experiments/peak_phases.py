"""Where a training step's peak memory lies: GiB above the static state after forward, at the
forward's and backward's peaks, after backward and during opt.step(), per fp8_linear_train method.

    python benchmarks/experiments/peak_phases.py coatstate_compiled_graphs,coatstate_compiled_graphs_rel
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
import fp8_linear_train as bench  # noqa: E402

from coatstate.models import ModelConfig  # noqa: E402


def main() -> None:
    cfg = dataclasses.replace(ModelConfig(**bench.TINYLLAMA, seq=2048), cast_residual=True)
    device, gib = torch.device("cuda"), 2.0**30
    print("method step: static | forward end, forward peak, backward peak, backward end, step peak (GiB)")
    for method in sys.argv[1].split(","):
        model, opt, ctx, _ = bench.build(method, cfg, device)
        idx = torch.randint(0, cfg.vocab, (8, cfg.seq + 1), device=device)
        for i in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16), ctx():
                loss = model(idx[:, :-1], idx[:, 1:])
            fwd_end, fwd_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            bwd_peak, bwd_end = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_peak = torch.cuda.max_memory_allocated()
            rel = [(x - base) / gib for x in (fwd_end, fwd_peak, bwd_peak, bwd_end, step_peak)]
            print(f"{method} {i}: {base / gib:.2f} | " + ", ".join(f"{x:.2f}" for x in rel), flush=True)
        del model, opt, loss
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
