"""Optimizer step time and state bytes on a GPT-shaped parameter set, against the peers.

    python benchmarks/optimizer_step.py                 # 1.31B params, fp32 and bf16, on CUDA
    python benchmarks/optimizer_step.py --device cpu --scale 0.001 --which torch,coat   # smoke test

Peers, where their packages import: torch.optim.AdamW(fused), bitsandbytes AdamW8bit, torchao
AdamWFp8. Per params dtype every optimizer is built at once, then rounds.py's interleaved rounds
time --steps samples of each; a sample is --burst steps back to back with one synchronisation (the
host queues the next step while the GPU works). Per step, median [min-max over rounds]: wall time,
GPU kernel time, host time, the paired ratio to torch's fused AdamW; beside them the state bytes per
parameter, the floor (bytes a step must move / the copy bandwidth measured in this run) and the
first step's seconds. Prints docs/benchmarks.md's table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import gpt_shapes, result_meta
from rounds import Variant, paired, run_rounds

import coatstate


def copy_bandwidth(device) -> float:
    if device.type != "cuda":  # (a CPU smoke run: a smaller copy timed by the host clock)
        x = torch.randn(4 * 2**20)
        y = x.clone()
        t0 = time.perf_counter()
        y.copy_(x)
        return 2 * x.numel() * 4 / (time.perf_counter() - t0)
    x = torch.randn(256 * 2**20, device=device)  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * x.numel() * 4 / statistics.median(times)


def make_optimizers(which):
    out = {}
    if "torch" in which:
        out["torch AdamW fused (fp32 states)"] = lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)
    if "bnb" in which:
        try:
            import bitsandbytes as bnb

            out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
        except Exception as e:  # noqa: BLE001
            print(f"bitsandbytes unavailable: {e}")
    if "torchao" in which:
        try:
            from torchao.optim import AdamWFp8

            out["torchao AdamWFp8"] = lambda ps: AdamWFp8(ps, lr=1e-3)
        except Exception as e:  # noqa: BLE001
            print(f"torchao unavailable: {e}")
    if "coat" in which:
        out["coatstate CompressedAdamW (expansion on)"] = lambda ps: coatstate.CompressedAdamW(
            ps, lr=1e-3, exp_avg_expand=True, exp_avg_sq_expand=True
        )
        out["coatstate CompressedAdamW (expansion off)"] = lambda ps: coatstate.CompressedAdamW(
            ps, lr=1e-3, exp_avg_expand=False, exp_avg_sq_expand=False
        )
    return out


def with_launch_config(name, factory, config):
    """A factory that sets the fused kernel's groups per program and warps, and optionally a
    register cap (config "GPPxWARPS" or "GPPxWARPSrREGS", e.g. 8x4r72)."""
    from coatstate.kernels import adamw_fused

    tiles, _, regs = config.partition("r")
    gpp, warps = (int(v) for v in tiles.split("x"))
    cap = int(regs) if regs else None

    def build(ps):
        adamw_fused.GROUPS_PER_PROGRAM, adamw_fused.NUM_WARPS, adamw_fused.MAX_REGISTERS = gpp, warps, cap
        return factory(ps)

    build.launch_config = (gpp, warps, cap)  # (set again before each step: the optimizers coexist)
    return f"{name} [{config}]", build


def expand_configs(optimizers, configs):
    if not configs:
        return optimizers
    out = {}
    for name, factory in optimizers.items():
        if "coatstate" not in name:
            out[name] = factory
            continue
        for c in configs.split(","):
            n, f = with_launch_config(name, factory, c)
            out[n] = f
    return out


def bytes_moved(name, n_params, n_compressed, p_bytes, g_bytes):
    """Fewest bytes a step must move: read+write p, read g, read+write each moment's state."""
    if "torch" in name:
        state = 2 * 4 * 2 * n_params
    else:  # 1-byte codes; 4-byte scale (+1-byte exponent) per 128 elements for the compressed ones
        per = 2 * (1 + 5 / 128) if "coatstate" in name and "on" in name else 2 * (1 + 4 / 128)
        state = 2 * per * n_compressed + 2 * 4 * 2 * (n_params - n_compressed)
    return n_params * (2 * p_bytes + g_bytes) + state


def build_optimizer(factory, shapes, dtype, device, warmup):
    """(params with random, never zero, gradients; the optimizer; its first step's seconds),
    after `warmup` more steps."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [
        torch.nn.Parameter(
            torch.randn(s, device=device, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype)
        )
        for s in shapes
    ]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen, dtype=torch.float32).mul_(1e-3).to(dtype)
    opt = factory(params)
    _sync(device)
    t0 = time.perf_counter()
    opt.step()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        opt.step()
    _sync(device)
    return params, opt, first


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_variants(optimizers: dict, shapes, dtype, device, burst: int, log=print):
    """(rounds.Variant per optimizer that built, {name: (params, opt, first step s)}); the step of a
    Variant is `burst` optimizer steps back to back."""
    variants, built = [], {}
    for name, factory in optimizers.items():
        try:
            params, opt, first = build_optimizer(factory, shapes, dtype, device, 0)
        except Exception as e:  # noqa: BLE001 - a peer failing is a result to report, not a crash
            log(f"{name} ({dtype}) failed: {type(e).__name__}: {e}")
            continue

        config = getattr(factory, "launch_config", None)

        def step(i: int, opt=opt, config=config) -> None:
            if config is not None:  # (the fused kernel reads its launch config from module globals)
                from coatstate.kernels import adamw_fused

                adamw_fused.GROUPS_PER_PROGRAM, adamw_fused.NUM_WARPS, adamw_fused.MAX_REGISTERS = config
            for _ in range(burst):
                opt.step()

        variants.append(Variant(name, step))
        built[name] = (params, opt, first)
    return variants, built


def result_rows(result: dict, built: dict, dtype, burst: int, bw: float, base: str | None) -> list[dict]:
    """One JSON row per optimizer: per-step times (median and spread over rounds), floor, bytes."""
    rows = []
    for name, r in result.items():
        params, opt, first = built[name]
        n = sum(p.numel() for p in params)
        n_comp = sum(p.numel() for p in params if p.dim() >= 2 and p.numel() >= 4096)
        per_step = {k: _per_step(r[k], burst) for k in ("wall_ms", "kernel_ms", "host_ms")}
        row = dict(
            name=name,
            dtype=str(dtype).replace("torch.", ""),
            params=n,
            state_bytes=coatstate.optim.optimizer_state_bytes(opt),
            pipelined_ms=per_step["wall_ms"]["median"],  # (read by report.py, experiments/)
            step_ms_spread=per_step["wall_ms"],
            gpu_ms_spread=per_step["kernel_ms"],
            host_ms_spread=per_step["host_ms"],
            busy=r["busy"],
            host_bound=r["host_bound"],
            vs_torch=paired(result, name, base) if base and base != name else None,
            vs_torch_gpu=paired(result, name, base, "round_kernel_ms") if base and base != name else None,
            first_step_s=first,
            peak_extra_bytes=r["peak_bytes"],
            bytes_moved=bytes_moved(name, n, n_comp, params[0].element_size(), params[0].grad.element_size()),
        )
        row["state_bytes_per_param"] = row["state_bytes"] / n
        row["floor_ms"] = row["bytes_moved"] / bw * 1e3
        row["achieved_TBps"] = row["bytes_moved"] / (row["pipelined_ms"] / 1e3) / 1e12
        if isinstance(opt, coatstate.CompressedAdamW):
            row["nonfinite_params"] = len(opt.nonfinite_parameters())
        rows.append(row)
    return rows


def _per_step(s: dict | None, burst: int) -> dict | None:
    return None if s is None else {k: (v / burst if k != "n" else v) for k, v in s.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed samples per optimizer per round")
    ap.add_argument("--burst", type=int, default=5, help="optimizer steps per sample, back to back")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--which", default="torch,bnb,torchao,coat")
    ap.add_argument("--configs", default="", help="fused kernel launch configs to sweep, e.g. 8x4,32x8")
    ap.add_argument("--out", default="benchmarks/results/optimizer_step.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    bw = copy_bandwidth(device)
    shapes = gpt_shapes(scale=args.scale)
    rows, errors = [], {}
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        optimizers = expand_configs(make_optimizers(args.which.split(",")), args.configs)
        variants, built = build_variants(optimizers, shapes, dtype, device, args.burst)
        result = run_rounds(
            variants, rounds=args.rounds, steps=args.steps, warmup=args.warmup, cuda=cuda, errors=errors
        )
        base = next((n for n in result if n.startswith("torch AdamW")), None)
        rows += result_rows(result, built, dtype, args.burst, bw, base)
        del variants, built
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    write_results(args.out, bw, rows, args.device, scale=args.scale, method="rounds", rounds=args.rounds,
                  steps=args.steps, burst=args.burst, errors=errors)  # fmt: skip


def write_results(out: str, bw: float, rows: list, device: str, show: bool = True, **meta) -> None:
    """JSON with the machine, date and copy bandwidth beside the rows; `show`: print the table
    docs/benchmarks.md makes of it (its section is named after the script, `out`'s stem aside)."""
    meta = result_meta(device=device) | dict(copy_bandwidth_Bps=bw, host=platform.node(), **meta)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if show:
        import report

        section = report.section_whole_state_step if "expand" in meta else report.section_optimizer_step
        print(section(dict(meta=meta, rows=[r for r in rows if "floor_ms" in r]), Path(out)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
