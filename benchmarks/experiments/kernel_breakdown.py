"""Where a training step's GPU time goes: kernel time per kernel family, one profiled step per variant.

    python benchmarks/experiments/kernel_breakdown.py fp8  # fp8_linear_train.py's methods, Llama 1.06B
    python benchmarks/experiments/kernel_breakdown.py gpt  # activation_memory.py variants, GPT-2-medium shape
    python benchmarks/experiments/kernel_breakdown.py llama \
        --variants "compiled: none,compiled: CompiledActivations"

A diagnostic beside the timed benchmarks (rounds.py's medians are the figures to quote): each
variant runs a few warm-up steps, then one step under torch.profiler; its CUDA kernels are summed
per family (GEMMs, attention, coatstate's pack/unpack kernels, inductor's pointwise / reduction /
persistent-reduction kernels by kind, the optimizer, the rest by name) and the longest kernels are
listed by name. Families make variants comparable although inductor names its kernels per graph.
The variants run one after another, not interleaved: compare the families within a run, not the
totals across runs. The profiler's own range of an optimizer step appears as a family of its own
("optim:Optimizer.step#..."): a span on the GPU timeline, not a kernel.

fp8 needs a GPU (the 1.06B model at seq 2048, batch 8, as fp8_linear_train.py); gpt/llama take
activation_memory.py's shape options. JSON to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

_GEMM = ("gemm", "nvjet", "cutlass", "sm90", "cublas", "splitk")
_ATTENTION = ("flash", "fmha", "attention")


def family(name: str) -> str:
    """The family a CUDA kernel's name belongs to."""
    n = name.lower()
    if any(k in n for k in _ATTENTION):
        return "attention"
    if any(k in n for k in _GEMM):
        return "gemm"
    if "pack" in n:  # coatstate's _pack_*/_unpack_* kernels (inductor's are named triton_*)
        return "coatstate:" + re.sub(r"_\d+$", "", name)[:60]
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optim:" + name[:50]
    if n.startswith("triton_"):  # triton_poi / triton_red / triton_per: pointwise, reduction, persistent
        return "inductor:" + name.split("_fused")[0]
    return "other:" + name[:50]


def breakdown(step, warmup: int = 2) -> dict:
    """Kernel ms per family and the longest kernels of one profiled step (after `warmup` steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    families, names = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            us = e.time_range.end - e.time_range.start
            families[family(e.name)] += us / 1e3
            names[e.name[:120]] += us / 1e3
    return {
        "wall_ms_profiled": wall_ms,
        "kernel_ms": sum(v for k, v in families.items() if not k.startswith("optim:Optimizer")),
        "families_ms": dict(families.most_common()),
        "top_kernels_ms": dict(names.most_common(25)),
    }


def show(title: str, results: dict) -> None:
    print(f"\n== {title}")
    keys = sorted(
        {k for r in results.values() for k in r["families_ms"]},
        key=lambda k: -max(r["families_ms"].get(k, 0.0) for r in results.values()),
    )
    print(f"{'family':<60}" + "".join(f"{n[:22]:>24}" for n in results))
    rows = [("kernel ms (all families but the optimizer span)", "kernel_ms", ".2f")]
    rows.append(("wall ms of the profiled step", "wall_ms_profiled", ".2f"))
    for label, key, f in rows:
        print(f"{label:<60}" + "".join(f"{r[key]:24{f}}" for r in results.values()))
    for k in keys[:30]:
        print(f"{k[:60]:<60}" + "".join(f"{r['families_ms'].get(k, 0.0):24.3f}" for r in results.values()))
    for n, r in results.items():
        print(f"-- longest kernels of {n}")
        for k, v in r["top_kernels_ms"].items():
            print(f"   {v:8.3f} ms  {k}")


def fp8_methods(methods: list[str], batch: int, seq: int) -> dict:
    import fp8_linear_train as F

    from coatstate.models import ModelConfig

    cfg = ModelConfig(**F.TINYLLAMA, seq=seq, cast_residual=True)
    device, out = torch.device("cuda"), {}
    for method in methods:
        model, opt, ctx, _ = F.build(method, cfg, device)
        g = torch.Generator(device=device).manual_seed(batch)
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device=device, generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        run = (model, opt, ctx, x, y, device)
        out[method] = breakdown(lambda run=run: F.train_step(*run), warmup=4)
        del model, opt, run
        torch.cuda.empty_cache()
    return out


def activation_variants(argv: list[str]) -> dict:
    import activation_memory as A

    args = A._parse(argv)
    table = A._chosen(args)
    model, opt, batches = A.build(args, table)
    variants, _, _ = A._variants(model, opt, batches, args, table)
    out = {}
    for v in variants:

        def step(v=v) -> None:
            if v.before_step is not None:  # (the CUDA-graph step marker)
                v.before_step()
            v.step(0)

        out[v.name] = breakdown(step, warmup=3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["fp8", "gpt", "llama"])
    p.add_argument("--methods", default="coatstate_compiled,coatstate_compiled_ca", help="fp8: methods")
    p.add_argument(
        "--variants",
        default="none,identity hooks,hooks only (all kept),compress_activations,compiled: none,"
        "compiled: CompiledActivations",
        help="gpt/llama: activation_memory.py variants",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048, help="fp8 only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_breakdown.py profiles CUDA kernels: it needs a GPU")
    if args.what == "fp8":
        results = fp8_methods(args.methods.split(","), args.batch, args.seq)
        title = f"FP8 training, Llama 1.06B, seq {args.seq}, batch {args.batch}"
    else:
        argv = ["--arch", args.what, "--compiled", "--batch", str(args.batch), "--variants", args.variants]
        if any(v.startswith("cudagraphs:") for v in args.variants.split(",")):
            argv.append("--cudagraphs")
        results = activation_variants(argv)
        title = f"{args.what}, activation_memory.py shape, batch {args.batch}"
    show(title, results)
    from common import result_meta

    out = Path(args.out or HERE / "results" / f"kernel_breakdown_{args.what}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "meta": result_meta(device="cuda"), "title": title, "variants": results}
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
