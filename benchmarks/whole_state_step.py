"""python benchmarks/whole_state_step.py          (CUDA; `--scale 0.02` for a quick run)

The whole training state per parameter (weights + master correction + gradients + moments) and the
step time, on optimizer_step.py's 1.31B GPT-shaped parameter set, for bfloat16 models with compact
master weights against the peers: torch AdamW fused (fp32 params: the reference; bf16 params: no
master), FlashOptim FlashAdamW (master 24 / 32), optimi AdamW (Kahan summation), torchao AdamW4bit
(no master), and coatstate CompressedAdamW (fp32 params; bf16 with master_bits 32 / 24 / 16; 24 with
4-bit moments or FP8 m + 4-bit v). Peers that do not import are skipped with a note. The variants
are timed in interleaved rounds of --steps back-to-back steps between CUDA events: median over
rounds with the min-max spread, the floor at the copy bandwidth measured in the same run, the first
step's time, and the bytes per parameter by kind ("release": without the gradients, as with
gradient release). Prints docs/benchmarks.md's table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from functools import partial

import torch
from coatstate.formats.defaults import EXPAND
from coatstate.formats.optimizer_state import MASTER_CORRECTION
from common import gpt_shapes
from optimizer_step import build_optimizer, copy_bandwidth, expand_configs, write_results

import coatstate


def variants(which: set[str]) -> dict:
    """name -> (parameter dtype, optimizer factory); a peer that does not import is named, not fatal."""
    f32, bf16, out = torch.float32, torch.bfloat16, {}
    if "torch" in which:
        adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)  # noqa: E731
        out["torch AdamW fused, fp32 params"] = (f32, adamw)
        out["torch AdamW fused, bf16 params (no master)"] = (bf16, adamw)
    if "flashoptim" in which:
        try:
            from flashoptim import FlashAdamW

            for bits in (24, 32):
                flash = lambda ps, b=bits: FlashAdamW(ps, lr=1e-3, master_weight_bits=b)  # noqa: E731
                out[f"FlashOptim FlashAdamW, bf16, master {bits}"] = (bf16, flash)
        except Exception as e:  # noqa: BLE001
            print(f"flashoptim unavailable: {type(e).__name__}: {e}")
    if "optimi" in which:
        try:
            from optimi import AdamW as OptimiAdamW

            out["optimi AdamW, bf16, kahan_sum"] = (bf16, lambda ps: OptimiAdamW(ps, lr=1e-3, kahan_sum=True))
        except Exception as e:  # noqa: BLE001
            print(f"optimi unavailable: {type(e).__name__}: {e}")
    if "torchao" in which:
        try:
            from torchao.optim import AdamW4bit

            out["torchao AdamW4bit, bf16 params (no master)"] = (bf16, lambda ps: AdamW4bit(ps, lr=1e-3))
        except Exception as e:  # noqa: BLE001
            print(f"torchao unavailable (AdamW4bit row skipped): {type(e).__name__}: {e}")
    if "coat" in which:  # FP8 moments at CompressedAdamW's defaults (the JSON's meta.expand says which)
        coat = lambda ps, **kw: coatstate.CompressedAdamW(ps, lr=1e-3, **kw)  # noqa: E731
        name = "coatstate CompressedAdamW"
        out[f"{name}, fp32 params"] = (f32, coat)
        for bits in (32, 24, 16):
            out[f"{name}, bf16, master_bits={bits}"] = (bf16, partial(coat, master_bits=bits))
        v4 = partial(coat, master_bits=24, exp_avg_sq_format="ue3m1_sqrt")  # issue #33
        out[f"{name}, bf16, master_bits=24, 4-bit moments"] = (bf16, partial(v4, exp_avg_format="e2m1"))
        out[f"{name}, bf16, master_bits=24, FP8 m + 4-bit v"] = (bf16, v4)
    return out


def _configured(table: dict, configs: str):
    """((name, factory), base name) per variant and launch config (optimizer_step.expand_configs)."""
    for base, (_, factory) in table.items():
        for name, f in expand_configs({base: factory}, configs).items():
            yield (name, f), base


def _tensors(obj, seen: set) -> int:
    """Bytes of the tensors reachable from an optimizer state value (a peer's wrapper objects
    included), each storage counted once."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensors(getattr(obj, n), seen) for n in names)
        key = (obj.untyped_storage().data_ptr(), obj.dtype, obj.numel())
        if key in seen or obj.numel() <= 1:
            return 0  # (step counters and other scalars are not per-parameter state)
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensors(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensors(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(_tensors(v, seen) for v in vars(obj).values())
    return 0


def state_split(opt) -> tuple[int, int]:
    """(master-correction bytes, all other optimizer-state bytes)."""
    seen: set = set()
    corr = moments = 0
    for state in opt.state.values():
        for key, value in state.items():
            n = _tensors(value, seen)
            if key == MASTER_CORRECTION or "error" in str(key).lower() or "ecc" in str(key).lower():
                corr += n
            elif "kahan" in str(key).lower() or "compensation" in str(key).lower():
                corr += n
            else:
                moments += n
    return corr, moments


def time_steps(opt, steps) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        opt.step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps


def bytes_moved(name: str, n: int, p_bytes: int, g_bytes: int) -> float:
    """Fewest bytes a step must move per the state each variant keeps (read + write of weights,
    correction and moments; read of gradients)."""
    if name.startswith("torch AdamW"):
        return n * (2 * p_bytes + g_bytes + 2 * 8)
    if "coatstate" in name:
        corr = 2 if "=32" in name else 1 if "=24" in name else 0
        fp8, four = 1 + 4 / 128, 0.5 + 4 / 128  # codes + per-group float32 scale, per moment
        moments = 2 * four if "4-bit moments" in name else fp8 + four if "4-bit v" in name else 2 * fp8
        return n * (2 * p_bytes + g_bytes + 2 * corr + 2 * moments)
    return float("nan")  # peers: their layouts are theirs; the measured time is what counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--which", default="torch,flashoptim,optimi,torchao,coat")
    ap.add_argument("--only", default="", help="keep the variants whose name holds one of these, e.g. 4-bit")
    ap.add_argument(
        "--configs", default="", help="fused kernel launch configs GPPxWARPS[rREGS], e.g. 8x4,2x1,8x4r72"
    )
    ap.add_argument("--out", default="benchmarks/results/whole_state_step.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    shapes = gpt_shapes(scale=args.scale)
    table = variants(set(args.which.split(",")))
    if args.only:
        table = {k: v for k, v in table.items() if any(w in k for w in args.only.split(","))}
    # (each variant is built and timed before the next: the config its factory sets holds meanwhile)
    table = {name: (table[base][0], factory) for (name, factory), base in _configured(table, args.configs)}
    rows = {name: {"name": name, "times_ms": []} for name in table}
    for rnd in range(args.rounds):
        for name, (dtype, factory) in table.items():
            row = rows[name]
            try:
                params, opt, first = build_optimizer(
                    factory, shapes, dtype, device, args.warmup if rnd == 0 else 1
                )
            except Exception as e:  # noqa: BLE001
                print(f"{name}: {type(e).__name__}: {e}")
                row["error"] = f"{type(e).__name__}: {e}"
                continue
            row["times_ms"].append(time_steps(opt, args.steps))
            if rnd == 0:
                n = sum(p.numel() for p in params)
                corr, moments = state_split(opt)
                row.update(
                    params=n,
                    first_step_s=first,
                    weights_B=params[0].element_size(),
                    grads_B=params[0].grad.element_size(),
                    correction_B=corr / n,
                    moments_B=moments / n,
                    bytes_moved=bytes_moved(name, n, params[0].element_size(), params[0].grad.element_size()),
                )
            del params, opt
            gc.collect()
            torch.cuda.empty_cache()
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        # written after every round, so a call cut short by its time limit keeps the rounds it ran
        report(rows, bw, args, rnd + 1, show=rnd + 1 == args.rounds)


def report(rows: dict, bw: float, args, rounds_done: int, show: bool = True) -> None:
    for r in rows.values():
        if not r["times_ms"] or "params" not in r:
            if show:
                print(f"{r['name']}: failed: {r.get('error')}")
            continue
        r["step_ms"] = statistics.median(r["times_ms"])
        r["spread_ms"] = [min(r["times_ms"]), max(r["times_ms"])]
        r["floor_ms"] = r["bytes_moved"] / bw * 1e3
        r["total_B"] = r["weights_B"] + r["correction_B"] + r["grads_B"] + r["moments_B"]
        r["total_with_release_B"] = r["total_B"] - r["grads_B"]
    meta = dict(scale=args.scale, steps=args.steps, rounds=rounds_done, expand=EXPAND)
    write_results(args.out, bw, list(rows.values()), "cuda", show, **meta)


if __name__ == "__main__":
    main()
