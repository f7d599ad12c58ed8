"""Checkpoint size and throughput: coatstate.save/load against torch.save/torch.load of AdamW.

    python benchmarks/checkpoint_io.py                      # 100M-param GPT-shaped state, ~2 min on 2 cores
    python benchmarks/checkpoint_io.py --params 20e6 --stdlib-steps 0   # quick

A GPT-shaped AdamW state after a few steps of structured gradients (lognormal row/column scales,
Zipf-sampled embedding rows), compressed by coatstate.optim.compress_adamw_state_dict: file sizes,
save/load MB/s (with fsync, on --dir), what zstd buys (file, FP8 codes, random codes) and the
sha256 cost. Then (--stdlib-steps) examples/train_gpt.py's byte-level GPT trained with AdamW and
with CompressedAdamW: each optimizer's own saved state. Prints docs/benchmarks.md's tables; JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import coatstate.checkpoint as ck
from coatstate.optim import compress_adamw_state_dict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))  # train_gpt, for the stdlib run
from common import result_meta  # noqa: E402

STDLIB_RUN = dict(layers=2, dim=256, seq=128, batch=16, lr=2e-3, seed=0)
"""examples/train_gpt.py's byte-level GPT on the standard library's source, for the stdlib section."""

VOCAB, WIDTH, CONTEXT = 50304, 768, 1024


def gpt_shapes(target: float) -> list[tuple[int, ...]]:
    per_layer = 12 * WIDTH * WIDTH + 13 * WIDTH  # qkv, proj, 4x mlp + their biases + 2 layer norms
    layers = max(1, round((target - (VOCAB + CONTEXT) * WIDTH) / per_layer))
    shapes = [(VOCAB, WIDTH), (CONTEXT, WIDTH)]
    for _ in range(layers):
        shapes += [(WIDTH,), (WIDTH,), (3 * WIDTH, WIDTH), (3 * WIDTH,), (WIDTH, WIDTH), (WIDTH,)]
        shapes += [(WIDTH,), (WIDTH,), (4 * WIDTH, WIDTH), (4 * WIDTH,), (WIDTH, 4 * WIDTH), (WIDTH,)]
    return shapes + [(WIDTH,), (WIDTH,)]


def adam_like_state(target: float, steps: int, seed: int = 0) -> tuple[dict, int]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in gpt_shapes(target)]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    for _ in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g)
            if p.dim() == 2:
                rows = torch.exp(torch.randn(p.shape[0], 1, generator=g))
                cols = torch.exp(0.5 * torch.randn(1, p.shape[1], generator=g))
                grad = grad * rows * cols * 1e-3
            if i == 0:  # embedding: only the rows of tokens seen in the batch get a gradient
                seen = torch.multinomial(zipf, 500_000, replacement=True, generator=g).unique()
                mask = torch.zeros(VOCAB, 1)
                mask[seen] = 1.0
                grad = grad * mask
            p.grad = grad
        opt.step()
    return opt.state_dict(), sum(p.numel() for p in params)


def timed(fn, repeat: int = 2) -> float:
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def torch_save_fsync(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def codes_bytes(sd: dict, moment: str) -> bytes:
    parts = [
        s[f"{moment}_codes"].view(torch.uint8).reshape(-1)
        for s in sd["state"].values()
        if f"{moment}_codes" in s
    ]
    return torch.cat(parts).numpy().tobytes()


def zstd_gains(data: bytes) -> dict[str, float]:
    import zstandard

    out = {}
    for level in (1, 3, 9):
        t = time.perf_counter()
        blob = zstandard.ZstdCompressor(level=level, write_checksum=True).compress(data)
        out[f"level{level}"] = round(len(data) / len(blob), 4)
        out[f"level{level}_MBps"] = round(len(data) / (time.perf_counter() - t) / 1e6, 1)
    return out


def stdlib_model(steps: int) -> dict:
    """examples/train_gpt.py's GPT (STDLIB_RUN) after `steps` steps, once with torch.optim.AdamW
    and once with CompressedAdamW: each optimizer's own state, file sizes and what zstd buys on
    real FP8 states."""
    import train_gpt

    runs = {}
    for name in ("adamw", "compressed"):
        argv = [f"--{k}={v}" for k, v in {**STDLIB_RUN, "steps": steps}.items()]
        args = train_gpt.parser().parse_args([*argv, "--optimizer", name, "--device", "cpu"])
        runs[name] = train_gpt.train(args, progress=False)
    adamw_opt, comp_opt = runs["adamw"]["opt"], runs["compressed"]["opt"]
    names = [n for n, _ in runs["compressed"]["model"].named_parameters()]
    buf = io.BytesIO()
    torch.save(adamw_opt.state_dict(), buf)
    base = buf.getbuffer().nbytes
    files = {"torch.save(AdamW)": base}
    with tempfile.TemporaryDirectory() as tmp:
        for label, compress in (("coatstate compressed", None), ("coatstate compressed+zstd", "zstd")):
            path = os.path.join(tmp, "ckpt.safetensors")
            ck.save(comp_opt, path, compress=compress, param_names=names)
            files[label] = os.path.getsize(path)
    comp_sd = comp_opt.state_dict()
    return {
        "params": runs["compressed"]["params"],
        "steps": steps,
        "final_loss": {k: round(sum(r["losses"][-20:]) / len(r["losses"][-20:]), 4) for k, r in runs.items()},
        "files": {k: {"bytes": b, "ratio_vs_torch_adamw": round(b / base, 4)} for k, b in files.items()},
        "ratio_compressed_vs_torch_adamw": round(files["coatstate compressed"] / base, 4),
        "zstd_file_gain": round(files["coatstate compressed"] / files["coatstate compressed+zstd"], 4),
        "zstd_codes_gain": {m: zstd_gains(codes_bytes(comp_sd, m)) for m in ("exp_avg", "exp_avg_sq")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps that shape the synthetic moments")
    ap.add_argument("--stdlib-steps", type=int, default=300, help="steps of the stdlib model (0: skip it)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    ap.add_argument("--out", default="benchmarks/results/checkpoint_io.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = result_meta(device="cpu") | {"threads": torch.get_num_threads()}
    work = Path(args.dir or tempfile.mkdtemp(prefix="coatstate-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    adamw_sd, n_params = adam_like_state(args.params, args.steps)
    print(f"{n_params / 1e6:.1f}M params, {args.steps} AdamW steps in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    comp_sd = compress_adamw_state_dict(adamw_sd)
    compress_s = time.perf_counter() - t

    files = {
        "torch.save(AdamW)": str(work / "adamw.pt"),
        "coatstate AdamW (full)": str(work / "full.safetensors"),
        "coatstate compressed": str(work / "comp.safetensors"),
        "coatstate compressed+zstd": str(work / "compz.safetensors"),
    }
    savers = {
        "torch.save(AdamW)": lambda p: torch_save_fsync(adamw_sd, p),
        "coatstate AdamW (full)": lambda p: ck.save(adamw_sd, p),
        "coatstate compressed": lambda p: ck.save(comp_sd, p),
        "coatstate compressed+zstd": lambda p: ck.save(comp_sd, p, compress="zstd"),
    }
    loaders = {
        "torch.save(AdamW)": lambda p: torch.load(p, weights_only=True),
        "coatstate AdamW (full)": ck.read_state_dict,
        "coatstate compressed": ck.read_state_dict,
        "coatstate compressed+zstd": ck.read_state_dict,
    }
    rows = {}
    for name, path in files.items():
        save_s = timed(lambda: savers[name](path))  # noqa: B023
        size = os.path.getsize(path)
        load_s = timed(lambda: loaders[name](path))  # noqa: B023
        rows[name] = {
            "bytes": size,
            "bytes_per_param": round(size / n_params, 4),
            "save_s": round(save_s, 3),
            "load_s": round(load_s, 3),
            "save_MBps": round(size / save_s / 1e6, 1),
            "load_MBps": round(size / load_s / 1e6, 1),
        }
    base = rows["torch.save(AdamW)"]["bytes"]
    for r in rows.values():
        r["ratio_vs_torch_adamw"] = round(r["bytes"] / base, 4)

    buf = io.BytesIO()
    torch.save(comp_sd, buf)
    state_bytes = sum(t.numel() * t.element_size() for s in comp_sd["state"].values() for t in s.values())
    all_tensors = [t for s in comp_sd["state"].values() for t in s.values()]
    sha_s = timed(
        lambda: [hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).digest() for t in all_tensors]
    )
    g = torch.Generator().manual_seed(1)
    random_codes = (torch.randn(50_000_000, generator=g) * 100).to(torch.float8_e4m3fn).view(torch.uint8)
    report = {
        "meta": meta,
        "params": n_params,
        "compress_adamw_state_dict_s": round(compress_s, 2),
        "files": rows,
        "ratio_compressed_vs_torch_adamw": rows["coatstate compressed"]["ratio_vs_torch_adamw"],
        "zstd_file_gain": round(
            rows["coatstate compressed"]["bytes"] / rows["coatstate compressed+zstd"]["bytes"], 4
        ),
        "zstd_codes_gain": {m: zstd_gains(codes_bytes(comp_sd, m)) for m in ("exp_avg", "exp_avg_sq")},
        "zstd_random_fp8_gain": zstd_gains(random_codes.numpy().tobytes()),
        "sha256_MBps": round(state_bytes / sha_s / 1e6, 1),
        "torch_save_of_compressed_sd_bytes": buf.getbuffer().nbytes,
    }
    if args.stdlib_steps:
        t = time.perf_counter()
        report["stdlib_model"] = stdlib_model(args.stdlib_steps)
        report["stdlib_model_s"] = round(time.perf_counter() - t, 1)

    from report import checkpoint_text  # the tables docs/benchmarks.md shows

    print(checkpoint_text(report, Path(args.out)))
    print(f"sha256 over the compressed state: {report['sha256_MBps']:.0f} MB/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    for path in files.values():
        os.unlink(path)


if __name__ == "__main__":
    main()
