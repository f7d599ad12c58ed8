"""python benchmarks/one_gpu.py --models 7b --max-minutes 8      (one GPU; --smoke: tiny, on CPU)

How many GPUs coatstate saves (issue 52): Llama-2-7B and Llama-2-13B shapes trained on ONE GPU of
80 GB, beside COAT's Table 7 (one 80 GB GPU, Llama-2-7B at context 2048: BF16 runs out of memory,
COAT peaks at 79.3 GB and runs 5,906 tokens/s; 13B needs 2 GPUs at context 1024).

Model: benchmarks/llama.py with random init. 7B: 32 layers x 4096, 32 heads, SwiGLU 11008;
13B: 40 x 5120, 40 heads, 13824; vocab 32000, seq 2048. A GPU with more than --cap-gb (80 GB,
1e9 bytes: the planner's unit) is capped there with torch.cuda.set_per_process_memory_fraction,
and the table says so. Setups (benchmarks/one_gpu_child.py builds them):
  bf16       bf16 weights + torch.optim.AdamW(fused=True) on fp32 master weights (COAT's BF16
             baseline: 16 bytes a parameter); expected to run out of memory: the table says where
  coatstate  FP8Linear (convert_to_fp8, head in bf16) + CompiledActivations (each block compiled)
             + CompressedAdamW(master_bits=24) on bf16 weights
  release    the same with gradient_release=True
  4bit       the same as release with 4-bit moments (exp_avg e2m1, exp_avg_sq ue3m1_sqrt)
Per setup: moments and master GB, activation GB (allocated by the forward and held for
backward), peak allocated GB and tokens/s (median [min-max] of the timed steps) at batch 1 and at
the largest batch found, and the planner's prediction (coatstate.planner, made first on the CPU)
beside each peak. The batch search starts at the planner's predicted largest batch and moves one
batch at a time (each new batch compiles the blocks again: static shapes keep every saved tensor
compressed); it stops at --max-batch or when the setup's share of --max-minutes is spent.

Each setup runs in a process of its own (an out-of-memory error or a compile cache must not
decide the next setup's numbers), with a time limit from --max-minutes: the setups share it
(half a share for bf16 and for a setup the planner says does not fit); a setup over its share
is killed and keeps what it measured, and so does one running when this script gets SIGTERM.
JSON (the common `meta` header) goes to --out after every setup; a table is printed at the end.
Memory: "activations" is what a forward allocates and holds until backward, "peak" is
torch.cuda.max_memory_allocated over the timed steps, both in GB of 1e9 bytes (the planner's).

    python benchmarks/one_gpu.py --models 13b --max-minutes 8 --setups coatstate,4bit
    python benchmarks/one_gpu.py --smoke        # CPU, 2 layers x 64: every setup, out-of-memory simulated
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import result_meta  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
from one_gpu_child import SETUPS  # noqa: E402

GB = 1e9
MODELS = {
    "7b": LlamaConfig(vocab=32000, dim=4096, layers=32, heads=32, hidden=11008, seq=2048),
    "13b": LlamaConfig(vocab=32000, dim=5120, layers=40, heads=40, hidden=13824, seq=2048),
    "smoke": LlamaConfig(vocab=256, dim=64, layers=2, heads=4, hidden=176, seq=64, loss_chunks=2),
}
LABELS = {"bf16": "bf16 AdamW", "coatstate": "coatstate", "release": "+ release", "4bit": "+ release + 4-bit"}
LEGEND = (
    "bf16 AdamW: bf16 weights, torch AdamW fused on fp32 masters; coatstate: FP8Linear + "
    "CompiledActivations + CompressedAdamW(master_bits=24);\n+ release: gradient_release=True; "
    "+ 4-bit: exp_avg e2m1, exp_avg_sq ue3m1_sqrt"
)


def weight(the_plan, setup: str) -> float:
    """A setup's share of the time budget: half for one expected to stop at batch 1 (the eager
    baseline, or any the planner says does not fit), which needs no batch search."""
    return 0.5 if setup == "bf16" or the_plan.max_batch(variants()[setup]) == 0 else 1.0


PAPER = {  # COAT (Xi et al. 2024) Table 7 and its text: one 80 GB GPU, context 2048
    "7b": "COAT Table 7, one 80 GB GPU, Llama-2-7B, seq 2048: BF16 and TE out of memory; COAT 79.3 GB "
    "peak (optimizer 13.1 GB, activations 8.1 GB), 5,906 tokens/s",
    "13b": "COAT: Llama-2-13B needs 2 GPUs even at context 1024 (73.2 GB and 2,137 tokens/s per GPU)",
}


def variants():
    """The planner's Variant of each setup."""
    from coatstate.planner import Variant

    return {
        "bf16": Variant("torch AdamW + BF16", "adamw", "none"),
        "coatstate": Variant("coatstate", "compressed", "fp8", master_bits=24),
        "release": Variant("release", "compressed", "fp8", master_bits=24, gradient_release=True),
        "4bit": Variant("4bit", "compressed", "fp8", master_bits=24, gradient_release=True, moments="4bit"),
    }


def make_plan(cfg: LlamaConfig, cap_bytes: float, setups: list[str]):
    """The planner's plan of the same model (traced on the CPU with fake tensors: seconds)."""
    from coatstate.planner import plan, spec_from_factory

    vs = variants()
    spec = spec_from_factory(lambda: Llama(cfg), f"benchmarks/llama.py ({cfg.layers} x {cfg.dim})")
    return plan(
        spec,
        seq=cfg.seq,
        batch=1,
        gpus=1,
        gpu_memory=cap_bytes,
        param_dtype="bf16",
        variants=[vs[s] for s in setups],
        progress=False,
    )


def predicted(the_plan, setup: str, batch: int) -> dict:
    return the_plan.breakdown(variants()[setup], batch, 1, "none")


class Stopped(Exception):
    """SIGTERM (e.g. from `timeout`): the running setup is killed and what was measured is written."""


def _stop(signum, frame) -> None:
    raise Stopped(f"signal {signum}")


def run_child(setup: str, cfg: LlamaConfig, args, guess: int, budget_s: float, limit_s: float) -> dict:
    """One setup in its own process, killed (its whole process group: inductor's compile workers
    too) after limit_s; what it wrote to its part file before then is kept."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / f"{setup}.json"
        cmd = [
            sys.executable,
            str(HERE / "one_gpu_child.py"),
            "--setup", setup,
            "--config", json.dumps(dataclasses.asdict(cfg)),
            "--out", str(part),
            "--device", args.device,
            "--cap-gb", str(args.cap_gb),
            "--warmup", str(args.warmup),
            "--steps", str(args.steps),
            "--probe-steps", str(args.probe_steps),
            "--guess", str(guess),
            "--max-batch", str(args.max_batch),
            "--budget-s", f"{budget_s:.0f}",
        ]  # fmt: skip
        if args.smoke:  # no OOM on a CPU: simulate one above batch 1, so the search's recovery runs
            cmd += ["--simulate-oom-above", "1"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
            status = "ok" if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            status = f"killed at its time limit of {limit_s:.0f} s"
        except Stopped:  # recorded below, then raised again by run_model
            status = "killed: this run was stopped (SIGTERM)"
        finally:
            if proc.poll() is None:  # its own session: a stopped parent must not leave it on the GPU
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:
            res = json.loads(part.read_text())
        except (OSError, ValueError):
            res = {}
    res["status"] = status
    res["stopped"] = status.startswith("killed: this run")
    res["wall_s"] = time.perf_counter() - t0
    res["budget_s"], res["limit_s"] = budget_s, limit_s
    return res


def add_predictions(res: dict, the_plan, setup: str) -> None:
    """The planner's peak (and its parts) beside every measured batch, and its largest batch."""
    res["predicted_max_batch"] = the_plan.max_batch(variants()[setup])
    res["predicted_batch1"] = predicted(the_plan, setup, 1)  # (also beside an out-of-memory error)
    for r in [res.get("batch1"), *(p for p in res.get("probes", []) if p.get("fits"))]:
        if r is None:
            continue
        pred = predicted(the_plan, setup, r["batch"])
        r["predicted"] = pred
        if "peak_bytes" in r:
            r["peak_error"] = pred["peak"] / r["peak_bytes"] - 1
    fitted = [p for p in res.get("probes", []) if p.get("fits")]
    res["largest"] = max(fitted, key=lambda p: p["batch"]) if fitted else res.get("batch1")


def run_model(name: str, args, t_end: float, doc: dict, write) -> None:
    cfg = MODELS[name]
    cap = args.cap_gb * GB if args.cap_gb > 0 else 80 * GB
    t0 = time.perf_counter()
    the_plan = make_plan(cfg, cap, args.setups)
    entry = doc["models"][name] = {
        "config": {**dataclasses.asdict(cfg), "params": cfg.params},
        "plan": the_plan.to_dict(),
        "plan_seconds": time.perf_counter() - t0,
        "paper": PAPER.get(name),
        "setups": {},
    }
    shape = f"{cfg.params / 1e9:.2f}B params, {cfg.layers} x {cfg.dim}, seq {cfg.seq}"
    print(f"\nLlama {name}: {shape}; planned in {entry['plan_seconds']:.1f} s", flush=True)
    todo = list(args.setups)
    while todo:
        setup = todo.pop(0)
        left = t_end - time.perf_counter()
        share = left * weight(the_plan, setup) / sum(weight(the_plan, s) for s in [setup, *todo])
        if share < args.min_setup_s:
            entry["setups"][setup] = {"status": f"skipped: {left:.0f} s of --max-minutes left"}
            add_predictions(entry["setups"][setup], the_plan, setup)
            print(f"{setup:10s} skipped: time budget spent", flush=True)
            continue
        guess = max(2, the_plan.max_batch(variants()[setup]))
        # no new probe after 70% of the share: the last probe compiles a new shape and runs steps
        res = run_child(setup, cfg, args, guess, budget_s=0.7 * share, limit_s=min(share + 45, left))
        add_predictions(res, the_plan, setup)
        entry["setups"][setup] = res
        if res["status"] != "ok":
            print(f"{setup:10s} {res['status']}", flush=True)
        write()
        if res["stopped"]:
            raise Stopped("SIGTERM")


def _gb(b) -> str:
    return "-" if b is None else f"{b / GB:.2f}" if b >= GB / 100 else f"{b / GB:.1e}"


def _column(res: dict) -> list[str]:
    """One setup's column of the table (rows as in `table`)."""
    b1, big = res.get("batch1"), res.get("largest")
    if b1 is None:
        oom = res.get("oom")
        why = "out of memory at batch 1" if oom else res.get("status", "no result")
        plan = res.get("predicted_batch1", {}).get("peak")
        return [
            why[:30],
            "",
            "",
            f"- ({_gb(plan)})",
            "",
            f"- (plan {res.get('predicted_max_batch', '-')})",
        ] + [""] * 5

    def peak(r):
        plan = _gb(r["predicted"]["peak"])
        if "peak_bytes" not in r:  # (CPU: no allocator peak)
            return f"- ({plan})"
        return f"{_gb(r['peak_bytes'])} ({plan}, {100 * r['peak_error']:+.1f}%)"

    def speed(r):
        t = r["tokens_per_s"]
        return f"{t['median']:.0f} [{t['min']:.0f}-{t['max']:.0f}]"

    search = res.get("search", {})
    note = " (time)" if search.get("cut_short_by_budget") else ""
    return [
        _gb(b1["moment_bytes"]),
        _gb(b1["master_bytes"]),
        _gb(b1["activation_bytes"]) if b1["activation_bytes"] else "-",
        peak(b1),
        speed(b1),
        f"{big['batch']}{note} (plan {res['predicted_max_batch']})",
        _gb(big["activation_bytes"]) if big["activation_bytes"] else "-",
        peak(big),
        speed(big),
        "yes" if b1["finite"] and big["finite"] else "NO",
        res.get("status", "")[:30],
    ]


def table(entry: dict, memory: dict | None) -> str:
    labels = [
        "moments GB",
        "master weights GB",
        "activations GB, batch 1",
        "peak GB b1 (planner, error)",
        "tokens/s b1 median [min-max]",
        "largest batch (planner's)",
        "activations GB there",
        "peak GB there (planner, error)",
        "tokens/s there",
        "losses finite",
        "status",
    ]
    names = list(entry["setups"])
    cols = [_column(entry["setups"][n]) for n in names]
    w = max(20, *(len(LABELS[n]) for n in names), *(len(c) for col in cols for c in col)) + 2
    lines = [f"{'':32}" + "".join(f"{LABELS[n]:>{w}}" for n in names)]
    lines += [f"{label:32}" + "".join(f"{c[i]:>{w}}" for c in cols) for i, label in enumerate(labels)]
    if memory:
        cap = memory.get("cap_bytes")
        capped = f"capped at {cap / GB:.0f} GB (fraction {memory['fraction']:.3f})" if cap else "not capped"
        lines.append(f"GPU: {memory['gpu']}, {memory['total_bytes'] / GB:.1f} GB, {capped}")
    lines.append(LEGEND)
    lines.append(
        "GB = 1e9 bytes of allocated memory (torch.cuda.max_memory_allocated); planner = coatstate.planner"
    )
    for n in names:  # the cap is the allocator's to keep: say so if it did not
        cap = (memory or {}).get("cap_bytes")
        runs = [entry["setups"][n].get("batch1"), *entry["setups"][n].get("probes", [])]
        over = [r["peak_reserved_bytes"] for r in runs if r and cap and r.get("peak_reserved_bytes", 0) > cap]
        if over:
            lines.append(
                f"WARNING {LABELS[n]}: reserved {max(over) / GB:.2f} GB, above the {cap / GB:.0f} GB cap"
            )
    for n in names:  # in full, what the columns cut short
        res = entry["setups"][n]
        oom = res.get("oom")
        if oom:
            held = f", {oom['allocated_bytes'] / GB:.1f} GB allocated" if "allocated_bytes" in oom else ""
            lines.append(f"{LABELS[n]}: out of memory at batch {oom['batch']} in {oom['phase']}{held}")
        if res.get("status", "ok") != "ok":
            lines.append(f"{LABELS[n]}: {res['status']}")
    if entry.get("paper"):
        lines.append(entry["paper"])
    return "\n".join(lines)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--models", default="7b", help="comma-separated, of 7b, 13b")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {list(SETUPS)}")
    p.add_argument("--max-minutes", type=float, default=8.0, help="for all models and setups of this run")
    p.add_argument("--min-setup-s", type=float, default=30.0, help="skip a setup with less time than this")
    p.add_argument(
        "--cap-gb", type=float, default=80.0, help="memory cap (1e9 bytes) on larger GPUs; 0: none"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at batch 1 (the first compiles)")
    p.add_argument("--steps", type=int, default=5, help="timed steps at batch 1")
    p.add_argument("--probe-steps", type=int, default=3, help="timed steps per batch-search probe (after 1)")
    p.add_argument("--max-batch", type=int, default=16, help="the batch search tries nothing above this")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 layers x 64, every setup, in seconds")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/one_gpu_<models>.json)")
    args = p.parse_args(argv)
    args.setups = args.setups.split(",")
    args.models = ["smoke"] if args.smoke else args.models.split(",")
    bad = sorted(set(args.setups) - set(SETUPS)) + sorted(set(args.models) - set(MODELS))
    if bad:
        p.error(f"unknown {bad}: --setups from {list(SETUPS)}, --models from 7b, 13b")
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.warmup, args.steps, args.probe_steps, args.max_batch, args.min_setup_s = 1, 3, 3, 2, 0.0
    if args.out is None:
        args.out = (
            "/tmp/one_gpu_smoke.json"
            if args.smoke
            else str(HERE / "results" / f"one_gpu_{'_'.join(args.models)}.json")
        )
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    t_end = time.perf_counter() + 60 * args.max_minutes
    # the parent never touches CUDA (its context would take memory from the setups' processes):
    # the GPU's name and memory come from the setups' own reports
    meta = result_meta(args, device="cpu") | {"device": args.device, "smoke": args.smoke}
    doc = {"meta": meta, "models": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        memory = next(
            (r["memory"] for m in doc["models"].values() for r in m["setups"].values() if "memory" in r), None
        )
        if memory:
            doc["meta"].update(machine=memory["gpu"], memory_cap=memory)
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    signal.signal(signal.SIGTERM, _stop)
    try:
        for name in args.models:
            run_model(name, args, t_end, doc, write)
            write()
    except Stopped:
        doc["meta"]["stopped"] = "SIGTERM before the end: the setups not listed did not run"
        write()
    for name, entry in doc["models"].items():
        c = entry["config"]
        print(f"\nLlama {name} ({c['params'] / 1e9:.2f}B params, seq {c['seq']}), one GPU:")
        print(table(entry, doc["meta"].get("memory_cap")))
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
