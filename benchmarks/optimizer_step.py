"""Optimizer step time and state bytes on a GPT-shaped parameter set, against the peers.

    python benchmarks/optimizer_step.py                 # 1.31B params, fp32 and bf16, on CUDA
    python benchmarks/optimizer_step.py --scale 0.05    # a smaller set

Peers measured in the same run (each only where its package imports): torch.optim.AdamW(fused),
bitsandbytes AdamW8bit, torchao AdamWFp8. Prints state bytes/param, the floor (bytes a step must
move / copy bandwidth measured in this run), and per optimizer:
  step ms    steps run back to back, as in a training loop (the host queues the next step while the
             GPU works): GPU time per step; TB/s = bytes moved / this time
  synced ms  median of single steps each followed by a synchronisation: adds the host's launch
             time (host ms, the Python/launch cost of opt.step()) wherever the GPU would idle
  first s    the first step (Triton compilation), peak extra MB: memory a step allocates
Writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import time

import torch

import coatstate


def gpt_shapes(vocab=50304, d=2048, layers=24, scale=1.0):
    """Parameter shapes of a GPT (tied embedding, pre-norm blocks with 4x MLP); 1.31B at scale 1."""
    d = max(128, int(d * scale**0.5) // 128 * 128)
    layers = max(1, int(layers * scale**0.5))
    shapes = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
        ]
    return shapes + [(d,), (d,)]


def copy_bandwidth(device) -> float:
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
    """A factory that sets the fused kernel's groups per program and warps (config "GPPxWARPS")."""
    from coatstate.kernels import adamw_fused

    gpp, warps = (int(v) for v in config.split("x"))

    def build(ps):
        adamw_fused.GROUPS_PER_PROGRAM, adamw_fused.NUM_WARPS = gpp, warps
        return factory(ps)

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
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    return params, opt, first


def run_one(name, factory, shapes, dtype, steps, warmup, device):
    params, opt, first = build_optimizer(factory, shapes, dtype, device, warmup)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, host = [], []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - h) * 1e3)  # Python/launch time: hidden behind the GPU
        b.record()  # in training only while the GPU is busier
        b.synchronize()
        times.append(a.elapsed_time(b))
    # back to back, no sync between steps (as in a training loop, where the host queues the next
    # step while the GPU works): the GPU's time per step once launch overheads overlap
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        opt.step()
    b.record()
    b.synchronize()
    pipelined = a.elapsed_time(b) / steps
    peak_extra = torch.cuda.max_memory_allocated() - base
    n = sum(p.numel() for p in params)
    sb = coatstate.optim.optimizer_state_bytes(opt)
    n_comp = sum(p.numel() for p in params if p.dim() >= 2 and p.numel() >= 4096)
    result = dict(
        name=name,
        dtype=str(dtype).replace("torch.", ""),
        params=n,
        state_bytes=sb,
        state_bytes_per_param=sb / n,
        step_ms=statistics.median(times),
        step_ms_min=min(times),
        host_ms=statistics.median(host),
        pipelined_ms=pipelined,
        first_step_s=first,
        peak_extra_bytes=peak_extra,
        bytes_moved=bytes_moved(name, n, n_comp, params[0].element_size(), params[0].grad.element_size()),
    )
    if isinstance(opt, coatstate.CompressedAdamW):
        bad = opt.nonfinite_parameters()
        result["nonfinite_params"] = len(bad)
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--which", default="torch,bnb,torchao,coat")
    ap.add_argument("--configs", default="", help="fused kernel launch configs to sweep, e.g. 8x4,32x8")
    ap.add_argument("--out", default="benchmarks/results/optimizer_step.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    shapes = gpt_shapes(scale=args.scale)
    rows = []
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        for name, factory in expand_configs(make_optimizers(args.which.split(",")), args.configs).items():
            try:
                r = run_one(name, factory, shapes, dtype, args.steps, args.warmup, device)
            except Exception as e:  # noqa: BLE001 - a peer failing is a result to report, not a crash
                print(f"{name} ({dt}) failed: {type(e).__name__}: {e}")
                continue
            r["floor_ms"] = r["bytes_moved"] / bw * 1e3
            r["achieved_TBps"] = r["bytes_moved"] / (r["pipelined_ms"] / 1e3) / 1e12
            rows.append(r)
            print(f"  {name} [{dt}]: {r['step_ms']:.2f} ms", flush=True)
    n = rows[0]["params"] if rows else 0
    print(f"\n{n / 1e9:.3f}B params, copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    print(
        f"{'optimizer':56s} {'dtype':9s} {'state B/param':>13s} {'floor ms':>8s} {'step ms':>8s} "
        f"{'TB/s':>6s} {'synced ms':>9s} {'host ms':>7s} {'first s':>7s} {'peak extra MB':>13s}"
    )
    for r in rows:
        print(
            f"{r['name']:56s} {r['dtype']:9s} {r['state_bytes_per_param']:13.3f} {r['floor_ms']:8.2f} "
            f"{r['pipelined_ms']:8.2f} {r['achieved_TBps']:6.2f} {r['step_ms']:9.2f} {r['host_ms']:7.2f} "
            f"{r['first_step_s']:7.2f} {r['peak_extra_bytes'] / 2**20:13.1f}"
        )
    write_results(args.out, bw, rows, scale=args.scale)


def write_results(out: str, bw: float, rows: list, **meta) -> None:
    """JSON with the machine, date and copy bandwidth beside the rows."""
    meta = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_bandwidth_Bps=bw,
        host=platform.node(),
        **meta,
    )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
