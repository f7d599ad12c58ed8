"""python benchmarks/experiments/master_train.py          (CUDA; --smoke: a tiny CPU run of every variant)

End to end, the ~1B Llama of fp8_linear_train.py (seq 2048, bf16 compute) trained with each way
of holding the training state, side by side in one process:
  fp32 + torch AdamW        float32 weights, bf16 autocast, torch AdamW fused (the reference)
  bf16 + torch AdamW        cast_model'd bfloat16 weights, torch AdamW fused (no master: lossy)
  FlashOptim master 24      bfloat16 weights, FlashAdamW(master_weight_bits=24)
  coatstate fp32            float32 weights, bf16 autocast, CompressedAdamW
  coatstate master 32/24/16 bfloat16 weights, CompressedAdamW(master_bits=...)
  coatstate master 24 + release   the same with gradient_release=True
Variants run in interleaved rounds (the order rotates per round); each round builds the model and
optimizer afresh (seeded), takes --warmup steps, then times --steps steps with CUDA events.
Reported per variant: tokens/s (median over rounds, min-max), peak allocated memory at --batch and
at batch 1, the largest batch that fits (a linear fit of those two peaks to the card's memory:
predicted, not tried), and the state in bytes per parameter (weights, correction, moments;
gradients are the weights' dtype, or one parameter's at a time with release). Writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import param_count  # noqa: E402
from fp8_linear_train import TINYLLAMA  # noqa: E402
from whole_state_step import state_split  # noqa: E402

import coatstate  # noqa: E402
from coatstate.models import Llama, ModelConfig  # noqa: E402


@functools.cache
def variants() -> dict:
    """name -> (bfloat16 weights?, optimizer factory)."""
    lr = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fused = torch.cuda.is_available()
    out = {
        "fp32 + torch AdamW": (False, lambda ps: torch.optim.AdamW(ps, fused=fused, **lr)),
        "bf16 + torch AdamW (no master)": (True, lambda ps: torch.optim.AdamW(ps, fused=fused, **lr)),
    }
    try:
        from flashoptim import FlashAdamW

        out["FlashOptim master 24"] = (True, lambda ps: FlashAdamW(ps, master_weight_bits=24, **lr))
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"flashoptim unavailable: {type(e).__name__}: {e}")
    out["coatstate fp32"] = (False, lambda ps: coatstate.CompressedAdamW(ps, **lr))
    for bits in (32, 24, 16):
        out[f"coatstate master {bits}"] = (
            True,
            lambda ps, b=bits: coatstate.CompressedAdamW(ps, master_bits=b, **lr),
        )
    out["coatstate master 24 + release"] = (
        True,
        lambda ps: coatstate.CompressedAdamW(ps, master_bits=24, gradient_release=True, **lr),
    )
    return out


def build(name: str, cfg: ModelConfig, device: torch.device):
    half, make = variants()[name]
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    if half:
        coatstate.cast_model(model)
    return model, make(model.parameters()), half


def train_steps(model, opt, half: bool, batch: int, steps: int, device: torch.device) -> float:
    """Seconds per step (CUDA events on a GPU), `steps` steps back to back."""
    cfg = model.cfg
    gen = torch.Generator(device=device).manual_seed(1)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device=device, generator=gen)
    cuda = device.type == "cuda"
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    t0 = time.perf_counter()
    if cuda:
        start.record()
    for _ in range(steps):
        with torch.autocast(device.type, torch.bfloat16, enabled=not half):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / steps
    return (time.perf_counter() - t0) / steps


def state_bytes(model, opt, release: bool) -> dict:
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    correction, moments = state_split(opt)
    grads = 0 if release else weights
    return {
        "weights": weights / n,
        "correction": correction / n,
        "gradients": grads / n,
        "moments": moments / n,
        "total": (weights + correction + grads + moments) / n,
    }


def measure(name: str, cfg, args, device, first_round: bool) -> dict:
    model, opt, half = build(name, cfg, device)
    out = {}
    if first_round and device.type == "cuda":  # the batch-1 peak, for the largest-batch fit
        torch.cuda.reset_peak_memory_stats()
        train_steps(model, opt, half, 1, 2, device)
        out["peak_batch1"] = torch.cuda.max_memory_allocated()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train_steps(model, opt, half, args.batch, 1, device)
    out["first_step_s"] = time.perf_counter() - t0
    if args.warmup:
        train_steps(model, opt, half, args.batch, args.warmup, device)
    out["step_s"] = train_steps(model, opt, half, args.batch, args.steps, device)
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
    if first_round:
        out["bytes_per_param"] = state_bytes(model, opt, "release" in name)
        out["params"] = sum(p.numel() for p in model.parameters())
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def summarize(runs: dict, args, capacity: int | None) -> dict:
    rows = {}
    tokens = args.batch * args.seq
    for name, rs in runs.items():
        tps = [tokens / r["step_s"] for r in rs]
        row = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "rounds": len(rs),
            "first_step_s": rs[0]["first_step_s"],
            "bytes_per_param": rs[0]["bytes_per_param"],
        }
        if "peak" in rs[0]:
            peak, peak1 = max(r["peak"] for r in rs), rs[0]["peak_batch1"]
            per_sample = (peak - peak1) / max(args.batch - 1, 1)
            row.update(peak_gib=peak / 2**30, peak_batch1_gib=peak1 / 2**30)
            if per_sample > 0:
                row["largest_batch_predicted"] = int(1 + (capacity - peak1) // per_sample)
        rows[name] = row
    return rows


def report(rows: dict) -> None:
    ref = rows.get("fp32 + torch AdamW")
    print(f"{'variant':<32} {'tok/s':>9} {'(min-max)':>17} {'vs fp32':>7} {'peak GiB':>8} {'max batch':>9} "
          f"{'B/param: w + corr + grad + mom = total':>40}")  # fmt: skip
    for name, r in rows.items():
        b = r["bytes_per_param"]
        parts = " + ".join(f"{b[k]:.2f}" for k in ("weights", "correction", "gradients", "moments"))
        split = f"{parts} = {b['total']:.2f}"
        rel = f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}" if ref else "-"
        spread = f"{r['tokens_per_s_min']:>8.0f}-{r['tokens_per_s_max']:<8.0f}"
        peak, batch = r.get("peak_gib", float("nan")), r.get("largest_batch_predicted", "-")
        print(f"{name:<32} {r['tokens_per_s']:>9.0f} {spread} {rel:>7} {peak:>8.2f} {batch:>9} {split:>40}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "master_train.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny CPU model, one round, one step")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch, args.seq, args.rounds, args.steps, args.warmup = 2, 32, 1, 1, 0
        cfg = ModelConfig(vocab=256, dim=64, layers=2, heads=2, hidden=128, seq=32, loss_chunks=2)
        cfg = dataclasses.replace(cfg, cast_residual=True)
    else:
        cfg = ModelConfig(**TINYLLAMA, seq=args.seq, cast_residual=True)
        torch.backends.cuda.matmul.allow_tf32 = True
    names = [n for n in variants() if not args.variants or n in args.variants.split(",")]
    capacity = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    runs: dict = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runs[name].append(measure(name, cfg, args, device, first_round=r == 0))
            print(f"round {r}: {name}: {runs[name][-1]['step_s'] * 1e3:.1f} ms/step", flush=True)
    rows = summarize(runs, args, capacity)
    report(rows)
    result = {
        "config": {
            **vars(args),
            "model_params": param_count(Llama, cfg),
            "device": torch.cuda.get_device_name() if capacity else "cpu",
        },
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }
    if not args.smoke:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
