"""python benchmarks/offload.py --max-minutes 8      (one GPU, capped at 24 GB; --smoke: tiny, on CPU)

Optimizer states in host memory (issue 53): Llama-2-7B shapes (coatstate.models.Llama, seq 2048)
in bf16 on ONE GPU capped at --cap-gb, activation checkpointing per block, batch 1. Setups, each
in a process of its own (they hold too much host memory to share one):
  coatstate  coatstate.HostOffloadAdamW(master_bits=24): FP8 moments and a 1-byte master
             correction on the host, stepped during backward by CompressedAdamW's CPU path
  coatstate-4bit, coatstate-plain: the same with 4-bit moments, or FP8 without range expansion
  torchao    torchao.optim.CPUOffloadOptimizer(offload_gradients=True) over torch's fused CPU
             AdamW on an fp32 master of each bf16 weight (skipped, with a note, without torchao)
Per setup: peak GPU memory, the host bytes of the optimizer states and of the weight and gradient
buffers, peak RSS, and per step the forward, backward, opt.step(), host step and copy times and
tokens/s: median [min-max] over rounds. The setups share --max-minutes; one over its share is
killed and keeps the steps it finished. JSON with the common `meta` header goes to --out.

    python benchmarks/offload.py --setups coatstate --rounds 2 --steps 1
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from common import median_range, result_meta  # noqa: E402

from coatstate.models import Llama, ModelConfig  # noqa: E402

HERE = Path(__file__).resolve().parent

GB = 1e9
COATSTATE_SETUPS = {  # HostOffloadAdamW's formats per setup: the host step's cost is in them
    "coatstate": {},
    "coatstate-4bit": dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt"),
    "coatstate-plain": dict(exp_avg_expand=False, exp_avg_sq_expand=False),
}
SETUPS = (*COATSTATE_SETUPS, "torchao")
OPT = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
MODELS = {
    "7b": ModelConfig(vocab=32000, dim=4096, layers=32, heads=32, hidden=11008, seq=2048),
    "smoke": ModelConfig(vocab=256, dim=64, layers=2, heads=4, hidden=176, seq=64, loss_chunks=2),
}


# ------------------------------------------------------------------------------ the setups
class HostMasterAdamW(torch.optim.AdamW):
    """torchao's CPUOffloadOptimizer builds one optimizer per host copy of a weight, in the
    weight's dtype (bf16 here); this one keeps an fp32 master of it and steps that with torch's
    fused CPU AdamW, so the host holds fp32 master and moments (12 bytes a parameter), the
    mixed-precision AdamW that offloaders keep. `host_step_s` sums the time of all its steps."""

    host_step_s = 0.0
    instances: list = []
    """every one built (torchao builds one per parameter): what the host holds, without reading
    torchao's private attributes"""

    def __init__(self, params, **kwargs) -> None:
        groups = [dict(g) for g in params]
        self.pairs = []
        for g in groups:
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            masters = [p.detach().float() if p.dtype != torch.float32 else p for p in ps]
            self.pairs += list(zip(ps, masters, strict=True))
            g["params"] = masters
        super().__init__(groups, **{**kwargs, "fused": True})
        HostMasterAdamW.instances.append(self)

    @torch.no_grad()
    def step(self, closure=None):
        t0 = time.perf_counter()
        for p, m in self.pairs:
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        super().step()
        for p, m in self.pairs:
            if m is not p:
                p.copy_(m)
                m.grad = None
        type(self).host_step_s += time.perf_counter() - t0


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build_optimizer(setup: str, model: torch.nn.Module):
    """(optimizer, host_bytes() -> dict, timings() -> dict of this step's seconds)."""
    if setup in COATSTATE_SETUPS:
        import coatstate

        opt = coatstate.HostOffloadAdamW(model.parameters(), master_bits=24, **OPT, **COATSTATE_SETUPS[setup])

        def host_bytes():
            b = opt.host_bytes()
            buffers = b["weights"] + b["grad_buffers"]
            return {"states": b["states"], "buffers": buffers, "reserved": b["reserved"]}

        def timings():
            t = opt.timings()
            return {"host_step": t.host_step_s, "d2h": t.d2h_s, "h2d": t.h2d_s, "step_wait": t.wait_s}

        return opt, host_bytes, timings
    from torchao.optim import CPUOffloadOptimizer  # ImportError: the caller notes the skipped row

    opt = CPUOffloadOptimizer(model.parameters(), HostMasterAdamW, offload_gradients=True, **OPT)

    def host_bytes_ao():
        inner = HostMasterAdamW.instances
        masters = [m for o in inner for p, m in o.pairs if m is not p]
        moments = [v for o in inner for s in o.state.values() for k, v in s.items() if k != "step"]
        hosts = [p for o in inner for p, _ in o.pairs]  # torchao's host copies (their .grad: buffers)
        buffers = _nbytes(hosts) + _nbytes(h.grad for h in hosts)
        return {"states": _nbytes(masters) + _nbytes(moments), "buffers": buffers}

    def timings_ao():
        host, HostMasterAdamW.host_step_s = HostMasterAdamW.host_step_s, 0.0
        return {"host_step": host, "d2h": None, "h2d": None, "step_wait": None}

    return opt, host_bytes_ao, timings_ao


def checkpoint_blocks(model: Llama) -> None:
    """Each block's activations are recomputed in backward (torch.utils.checkpoint): only the
    residual stream between blocks is held, so 7B at seq 2048 fits beside its 13.5 GB of weights."""
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, cos, sin, f=forward: torch.utils.checkpoint.checkpoint(
            f, x, cos, sin, use_reentrant=False
        )


# ------------------------------------------------------------------------------ one setup
def run_setup(setup: str, cfg: ModelConfig, device: str, cap_gb: float, batch: int, rounds: int,
              steps: int, seconds: float, write) -> dict:  # fmt: skip
    """Build the model and optimizer, run a warm-up step then `rounds` x `steps` timed steps (fewer
    when `seconds` run out); `write(result)` after every step."""
    start = time.perf_counter()
    cuda = device.startswith("cuda")
    result: dict = {"status": "building", "setup": setup, "batch": batch, "steps": []}
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        if total > cap_gb * GB:
            torch.cuda.set_per_process_memory_fraction(cap_gb * GB / total)
        result["gpu_total_gb"], result["cap_gb"] = total / GB, min(cap_gb, total / GB)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an fp32 7B (27 GB) would not fit the cap
    with torch.device(device):
        model = Llama(cfg)
    torch.set_default_dtype(torch.float32)
    checkpoint_blocks(model)
    result["params"] = sum(p.numel() for p in model.parameters())
    try:
        opt, host_bytes, timings = build_optimizer(setup, model)
    except ImportError as e:
        result.update(status="skipped", note=f"torchao is not installed ({e})")
        return result
    result["status"] = "running"
    gen = torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(1 + rounds * steps):
        last = (result["steps"] or [result.get("warmup")])[-1]
        if last is not None and time.perf_counter() - start + 1.5 * last["total_s"] > seconds - 10:
            result["cut_short_by_budget"] = True
            break
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen).to(device)
        if cuda and i == 1:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        loss = model(idx[:, :-1], idx[:, 1:])
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        opt.zero_grad()
        row = {"forward_s": t1 - t0, "backward_s": t2 - t1, "step_s": t3 - t2, "total_s": t3 - t0,
               "loss": loss.item(), **{f"{k}_s": v for k, v in timings().items()}}  # fmt: skip
        row["tokens_per_s"] = batch * cfg.seq / row["total_s"]
        if i == 0:
            result["warmup"] = row
        else:
            result["steps"].append(row)
        result["host_bytes"] = host_bytes()
        result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        if cuda:
            result["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / GB
        # a setup whose first step takes most of its share reports that step, marked as such
        result["rounds"] = summarize(result["steps"] or [result["warmup"]], steps)
        result["rounds_from_warmup"] = not result["steps"]
        write(result)
    result["status"] = "ok" if result["steps"] else "no timed step"
    result["finite"] = all(torch.isfinite(torch.tensor(r["loss"])) for r in result["steps"])
    return result


def summarize(rows: list[dict], steps: int) -> dict:
    """Per quantity: median [min-max] over rounds of each round's median (a round: `steps` steps)."""
    out = {}
    keys = ("forward_s", "backward_s", "step_s", "host_step_s", "d2h_s", "h2d_s", "total_s", "tokens_per_s")
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        per_round = [statistics.median(values[k : k + steps]) for k in range(0, len(values), steps)]
        if per_round:
            out[key] = median_range(per_round)
    return out


# ------------------------------------------------------------------------------ the parent
def run_child(setup: str, args, cfg_name: str, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        cmd = [sys.executable, __file__, "--child", setup, "--part", str(part), "--seconds", str(seconds)]
        cmd += ["--model", cfg_name, "--cap-gb", str(args.cap_gb), "--batch", str(args.batch)]
        cmd += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--device", args.device]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        try:
            proc = subprocess.run(cmd, timeout=seconds, capture_output=True, text=True)
            failed = proc.returncode != 0 and (proc.stderr or "").strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            failed = ["killed at its share of --max-minutes"]
        result = json.loads(part.read_text()) if part.exists() else {"setup": setup, "steps": []}
    if failed:
        result["status"] = "stopped: " + " | ".join(failed)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2 layers x 64 on the CPU (torchao's row skipped)")
    ap.add_argument("--max-minutes", type=float, default=8.0)
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (0: all)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "offload.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cfg_name = args.model or ("smoke" if args.smoke else "7b")
    cfg = MODELS[cfg_name]
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    if args.child:
        part = Path(args.part)
        write = lambda r: part.write_text(json.dumps(r, indent=1))  # noqa: E731
        write(run_setup(args.child, cfg, args.device, args.cap_gb, args.batch, args.rounds, args.steps,
                        args.seconds, write))  # fmt: skip
        return 0
    setups = [s for s in args.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        ap.error(f"unknown setups {sorted(unknown)}; choose from {SETUPS}")
    budget = args.max_minutes * 60 - 20  # (the parent's own start and the children's teardown)
    results = {}
    # torchao first: its step is short and predictable; coatstate then gets what is left
    for k, setup in enumerate(sorted(setups, key=lambda s: s != "torchao")):
        if setup == "torchao" and args.device == "cpu":
            results[setup] = {"setup": setup, "status": "skipped", "note": "CPUOffloadOptimizer needs CUDA"}
        elif setup == "torchao" and importlib.util.find_spec("torchao") is None:
            results[setup] = {"setup": setup, "status": "skipped", "note": "torchao is not installed"}
        else:
            left = budget - sum(r.get("elapsed_s", 0) for r in results.values())
            t0 = time.perf_counter()
            results[setup] = run_child(setup, args, cfg_name, left / (len(setups) - k))
            results[setup]["elapsed_s"] = time.perf_counter() - t0
            done = results[setup]
            print(f"{setup}: {done.get('status')} in {done['elapsed_s']:.0f} s", flush=True)
        meta = {**result_meta(args, args.device), "smoke": args.smoke}
        out = {"meta": meta, "model": dataclasses.asdict(cfg), "setups": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    from report import offload_table

    print(offload_table({s: results[s] for s in setups}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
