"""python benchmarks/fp8_linear_parity.py

Does training with FP8 linear layers reach the loss of BF16 training? The byte-level GPT of
benchmarks/models.py on the Python standard library's own source (examples/train_gpt.py's corpus
and batches), trained twice from the same initial weights on the same batches, both under
bfloat16 autocast with torch.optim.AdamW:
  bf16: the model as is (its GEMMs in bfloat16);
  fp8:  coatstate.nn.convert_to_fp8(model): every linear layer but the tied head (kept in bf16,
        as torchtitan's float8 recipe does; --fp8-head converts it too) with E4M3 inputs and
        weights and E5M2 output gradients (--grad-fmt), emulated in fp32 on CPU: the same
        quantized math as the H200's torch._scaled_mm path.
Pass: |mean of the last 20 losses (fp8) / same (bf16) - 1| <= 1%. Writes
benchmarks/results/fp8_linear_parity.json (losses of every step included). About 45 s on 2 idle
CPU cores (the FP8 run is ~4x slower than bf16: quantization in pure torch); `--steps 30` for a
quick look. Measured (300 steps, same batches; final loss relative to bf16):
  gradients   head in bf16 (default)   head in FP8 (--fp8-head)      (--matrix runs all four)
  E5M2        +0.60%                   +1.05%
  E4M3        -0.11%                   +4.33%   (the logits' gradient needs E5M2's range)
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from models import GPT, ModelConfig  # noqa: E402
from train_gpt import batches, stdlib_corpus  # noqa: E402

from coatstate.nn import FP8LinearConfig, convert_to_fp8, fp8_fallbacks  # noqa: E402

TOLERANCE = 0.01
"""Largest relative difference of the final losses (mean of the last `tail` steps) that passes."""


def train(model: torch.nn.Module, data: torch.Tensor, args) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    stream = batches(data, args.batch, args.seq, args.seed)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x, y = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def final_loss(losses: list[float], tail: int) -> float:
    return sum(losses[-tail:]) / len(losses[-tail:])


def fp8_variant(base: torch.nn.Module, grad_fmt: str, fp8_head: bool) -> torch.nn.Module:
    keep = () if fp8_head else ("head",)
    model = convert_to_fp8(
        copy.deepcopy(base),
        filter_fn=lambda mod, name: name not in keep,
        config=FP8LinearConfig(grad_fmt=grad_fmt),
    )
    if fp8_fallbacks(model):
        raise SystemExit(
            f"layers fell back to high precision: {fp8_fallbacks(model)}; use dims divisible by 16"
        )
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tail", type=int, default=20, help="final loss = mean of the last TAIL steps")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-fmt", default="e5m2", choices=["e5m2", "e4m3"])
    ap.add_argument("--fp8-head", action="store_true", help="convert the (tied) head too")
    ap.add_argument("--matrix", action="store_true", help="also the other three grad-format/head variants")
    ap.add_argument("--out", default=str(HERE / "results" / "fp8_linear_parity.json"))
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    cfg = ModelConfig(vocab=256, layers=args.layers, dim=args.dim, heads=max(1, args.dim // 64), seq=args.seq)
    base = GPT(cfg)
    variants = [(args.grad_fmt, args.fp8_head)]
    if args.matrix:
        variants += [(g, h) for g in ("e5m2", "e4m3") for h in (False, True) if (g, h) != variants[0]]
    models = {"bf16": base} | {
        f"fp8 {g}{' fp8-head' if h else ''}": fp8_variant(base, g, h) for g, h in variants
    }
    data = stdlib_corpus()
    runs = {}
    for name, model in models.items():
        losses, seconds = train(model, data, args)
        runs[name] = dict(final_loss=final_loss(losses, args.tail), seconds=seconds, losses=losses)
        if name != "bf16":
            runs[name]["relative_difference"] = runs[name]["final_loss"] / runs["bf16"]["final_loss"] - 1.0
        rel = runs[name].get("relative_difference", 0.0)
        print(
            f"{name:20s} final loss (mean of last {args.tail}) {runs[name]['final_loss']:.4f} "
            f"({rel:+.2%} vs bf16)  {seconds:6.1f} s",
            flush=True,
        )
    main_run = list(models)[1]
    rel = runs[main_run]["relative_difference"]
    passed = abs(rel) <= TOLERANCE
    print(
        f"{main_run}: fp8 / bf16 - 1 = {rel:+.4%} (tolerance {TOLERANCE:.0%}): {'PASS' if passed else 'FAIL'}"
    )
    result = dict(
        command="python benchmarks/fp8_linear_parity.py " + " ".join(sys.argv[1:] if argv is None else argv),
        config=vars(args) | {"heads": cfg.heads, "vocab": cfg.vocab},
        params=sum(p.numel() for p in base.parameters()),
        compared=main_run,
        relative_difference=rel,
        tolerance=TOLERANCE,
        passed=passed,
        torch=torch.__version__,
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
        runs=runs,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
