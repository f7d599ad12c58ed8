"""`coatstate plan` against measurement: predicted vs measured bytes for the activation benchmark.

    python benchmarks/plan_check.py            # H200: GPT-2-medium (24 x 1024), seq 1024, batch 8
    python benchmarks/plan_check.py --smoke    # CPU: 2 layers, seq 128, batch 2 (checks the script)
    python benchmarks/plan_check.py --device cpu --seq 128 --batch 2   # CPU: the full 24 layers

The setup is benchmarks/activation_memory.py's: benchmarks/models.py GPT, fp32 params and
grads (kept allocated: zero_grad(set_to_none=False)), bf16 autocast, loss over 8 checkpointed
chunks of tokens. The plan is made first, on CPU, from the model factory (the planner traces 2
of its layers at small token counts). Then each variant trains a few steps on --device:

- torch AdamW, no hooks (what the benchmark calls "none");
- torch AdamW + compress_activations (the benchmark's "compress_activations");
- CompressedAdamW + compress_activations.

Measured: optimizer state bytes (CompressedAdamW.state_bytes(); AdamW's exp_avg/exp_avg_sq),
saved activation bytes (compress_activations' ActivationStats: held, and what it would hold
uncompressed), and on CUDA the peak, torch.cuda.max_memory_allocated over --steps steps after
--warmup (it includes params, grads and states). Checks: optimizer and saved activation bytes
within 5%; on CUDA also the bytes allocated before a step (params, grads, states) within 5% and
the peak within 10%. JSON to --out; exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, ModelConfig, add_shape_args  # noqa: E402

from coatstate import CompressedAdamW  # noqa: E402
from coatstate.optim import optimizer_state_bytes  # noqa: E402
from coatstate.activations import KEEP_ALL  # noqa: E402
from coatstate.activations import compress_activations  # noqa: E402
from coatstate.planner import Variant, plan, spec_from_factory  # noqa: E402

VARIANTS = [
    Variant("torch AdamW", "adamw", "none"),
    Variant("torch AdamW + compress_activations", "adamw", "compressed"),
    Variant("CompressedAdamW + compress_activations", "compressed", "compressed"),
]
TOLERANCE = {"optimizer": 0.05, "activations": 0.05, "static": 0.05, "peak": 0.10}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU, 2 layers, seq 128, batch 2, 1 step")
    p.add_argument("--out", default="benchmarks/results/plan_check.json")
    args = p.parse_args()
    if args.smoke:
        args.device, args.layers, args.seq, args.batch, args.steps, args.warmup = "cpu", 2, 128, 2, 1, 0
    return args


def measure(cfg: ModelConfig, variant: Variant, args, device: str) -> dict:
    """Train `variant` a few steps; bytes held by the optimizer and by saved tensors, and the peak."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if variant.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    else:
        opt = CompressedAdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device),) * 2 for _ in range(2)]
    compress = variant.activations == "compressed"
    cuda = device == "cuda"

    def step(i: int, ctx):
        idx, tgt = batches[i % len(batches)]
        with ctx, torch.autocast(device, dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return ctx

    # one step with stats: saved bytes (the uncompressed variant keeps everything: same tensors)
    stats = step(0, compress_activations() if compress else compress_activations(**KEEP_ALL)).stats
    row = {
        "optimizer": optimizer_state_bytes(opt),
        "activations": stats.activation_bytes_held,
        "activations_uncompressed": stats.activation_bytes_original,
    }
    if not cuda:  # no allocator peak on CPU: the bytes above are what is checked
        return row
    make_ctx = compress_activations if compress else contextlib.nullcontext
    for i in range(args.warmup):
        step(i, make_ctx())
    torch.cuda.synchronize()
    row["static"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i, make_ctx())
    torch.cuda.synchronize()
    row["peak"] = torch.cuda.max_memory_allocated()
    row["seconds"] = time.perf_counter() - t0
    return row


def main() -> int:
    args = _parse()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --smoke or --device cpu")
    cfg = ModelConfig.from_args(args)
    t0 = time.perf_counter()
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 80e9
    predicted = plan(
        spec_from_factory(lambda: GPT(cfg), f"benchmarks/models.py GPT ({args.layers} x {args.dim})"),
        seq=args.seq,
        batch=args.batch,
        param_dtype="fp32",
        autocast=True,
        gpu_memory=gpu_memory,
        variants=VARIANTS,
        grads_kept=True,  # the measured loop's zero_grad(set_to_none=False)
    )
    plan_seconds = time.perf_counter() - t0
    print(predicted.table())
    print(f"(plan made on CPU in {plan_seconds:.1f} s)\n")
    rows, ok = [], True
    for r in predicted.rows:
        got = measure(cfg, r.variant, args, device)
        if device == "cuda":
            torch.cuda.empty_cache()
        want = dict(r.bytes)
        want["static"] = sum(want[k] for k in ("params", "grads", "master", "optimizer"))
        checks = {}
        for key, tol in TOLERANCE.items():
            if key in got:
                err = want[key] / got[key] - 1 if got[key] else float("inf")
                checks[key] = {
                    "predicted": want[key],
                    "measured": got[key],
                    "rel_error": err,
                    "tolerance": tol,
                    "ok": abs(err) <= tol,
                }
                ok &= abs(err) <= tol
        rows.append({"variant": r.variant.name, "predicted": want, "measured": got, "checks": checks})
        for key, c in checks.items():
            print(
                f"{r.variant.name:<40} {key:<12} predicted {c['predicted'] / 1e9:8.3f} GB  measured "
                f"{c['measured'] / 1e9:8.3f} GB  error {100 * c['rel_error']:+6.2f}%  "
                f"{'ok' if c['ok'] else 'FAIL'} (within {100 * c['tolerance']:.0f}%)"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "torch": torch.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "plan": predicted.to_dict(),
        "plan_seconds": plan_seconds,
        "rows": rows,
        "all_ok": ok,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"{'all checks pass' if ok else 'SOME CHECKS FAIL'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
