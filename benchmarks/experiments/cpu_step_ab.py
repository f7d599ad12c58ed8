"""Two versions of the C++ CPU step side by side: kernels/cpu_step.cpp (and cpu_codec.h) at a git
revision against the working tree's, in interleaved rounds on the same parameters.

    python benchmarks/experiments/cpu_step_ab.py --base HEAD --threads 1 2 --out /tmp/ab.json

Each version is built into its own shared library; every format's optimizer is created once per
version and the versions take turns (order alternating per round), 3 steps a turn. Prints, per
format and thread count, ns per parameter (median [min-max] over rounds) and the per-round ratio
new / base. Three GPT-block-sized matrices (20M parameters; fp32, bf16 for the master row), random gradients.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from coatstate.kernels import cpu_step

import coatstate

ROOT = Path(__file__).resolve().parents[2]
FORMATS = {  # name: (options, parameter dtype)
    "defaults": ({}, torch.float32),
    "plain E4M3": (dict(exp_avg_expand=False, exp_avg_sq_expand=False), torch.float32),
    "4-bit": (dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt"), torch.float32),
    "bf16 master24": ({}, torch.bfloat16),
}


def load(source_dir: Path):
    """The (library, rounding) pair cpu_step.library() would give for the sources in source_dir."""
    cpu_step.SOURCE = source_dir / "cpu_step.cpp"
    cpu_step.HEADERS = (source_dir / "cpu_codec.h",)
    cpu_step.library.cache_clear()
    built = cpu_step.library()
    if built is None:
        raise SystemExit(f"could not build the CPU step from {source_dir}")
    return built


def use(built) -> None:
    cpu_step.library = functools.cache(lambda: built)


def compare(versions: dict, threads: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [(2048, 2048), (2048, 2048), (2048, 5632)]
    start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    n = sum(x.numel() for x in start)
    out = {}
    for name, (options, dtype) in FORMATS.items():
        opts = {}
        for label, built in versions.items():
            use(built)
            params = [torch.nn.Parameter(x.to(dtype)) for x in start]
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(dtype)
            opts[label] = coatstate.CompressedAdamW(params, **options)
            opts[label].step()  # states created
        per_round = {label: [] for label in versions}
        for r in range(rounds):
            for label in list(versions) if r % 2 == 0 else list(versions)[::-1]:
                use(versions[label])
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    opts[label].step()
                    times.append(time.perf_counter() - t)
                per_round[label].append(1e9 * statistics.median(times) / n)
        base, new = per_round["base"], per_round["new"]
        ratios = sorted(b / a for a, b in zip(base, new, strict=True))
        ratio = dict(median=statistics.median(ratios), min=ratios[0], max=ratios[-1])
        out[name] = dict(base_ns=base, new_ns=new, new_over_base=ratio)
        cells = [f"{k} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for k, v in per_round.items()]
        print(f"{threads} thread(s) {name:11s} " + "  ".join(cells), end="", flush=True)
        print(f"  new/base {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base version")
    ap.add_argument("--base-dir", default=None, help="or a folder holding the base's two files")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp)
        for name in ("cpu_step.cpp", "cpu_codec.h"):
            show = ["git", "show", f"{args.base}:kernels/{name}"]
            if args.base_dir:  # (a machine without the repository's history)
                text = (Path(args.base_dir) / name).read_text()
            else:
                text = subprocess.run(show, cwd=ROOT, capture_output=True, text=True, check=True).stdout
            (base_dir / name).write_text(text)
        versions = {"base": load(base_dir), "new": load(ROOT / "kernels")}
        results = {str(t): compare(versions, t, args.rounds) for t in args.threads}
    if args.out:
        record = dict(base=args.base_dir or args.base, rounds=args.rounds, results=results)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
