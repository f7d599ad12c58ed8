"""python benchmarks/one_gpu.py --models 7b --max-minutes 8      (one GPU; --smoke: tiny, on CPU)

How many GPUs coatstate saves (issue 52): Llama-2-7B and 13B shapes (coatstate.models.Llama,
random init, seq 2048) trained on ONE GPU capped at --cap-gb (80 GB of 1e9 bytes, with
torch.cuda.set_per_process_memory_fraction on a larger card), beside COAT's Table 7. Setups
(one_gpu_child.py builds and runs each in a process of its own, so that an out-of-memory error or
a compile cache does not decide the next setup's numbers): bf16 + torch AdamW on fp32 masters
(COAT's BF16 baseline), the FP8 recipe (FP8Linear + CompiledActivations + CompressedAdamW with
master_bits=24), + gradient release, + 4-bit moments. Per setup, at batch 1 and at the largest
batch a search from the planner's guess finds (one batch at a time, within the setup's share of
--max-minutes): moments, master, activation and peak GB, tokens/s, and coatstate.planner's
prediction beside each peak. A setup over its share is killed and keeps what it measured, and so
does one running when this script gets SIGTERM. Prints docs/benchmarks.md's table; JSON to --out.

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

from common import param_count, result_meta
from one_gpu_child import SETUPS

from coatstate.models import Llama, ModelConfig

HERE = Path(__file__).resolve().parent

GB = 1e9
MODELS = {
    "7b": ModelConfig(vocab=32000, dim=4096, layers=32, heads=32, hidden=11008, seq=2048),
    "13b": ModelConfig(vocab=32000, dim=5120, layers=40, heads=40, hidden=13824, seq=2048),
    "smoke": ModelConfig(vocab=256, dim=64, layers=2, heads=4, hidden=176, seq=64, loss_chunks=2),
}
LABELS = {"bf16": "bf16 AdamW", "coatstate": "coatstate", "release": "+ release", "4bit": "+ release + 4-bit"}


def planned_batch(the_plan, setup: str) -> int | None:
    """The planner's largest batch for a setup; None where the plan left its row out (its notes
    say why: e.g. the blocks did not compile on this machine's CPU), so the run still measures."""
    v = variants()[setup]
    return the_plan.max_batch(v) if v.name in {p.name for p in the_plan.variants} else None


def weight(the_plan, setup: str) -> float:
    """A setup's share of the time budget: half for one expected to stop at batch 1 (the eager
    baseline, or any the planner says does not fit), which needs no batch search."""
    return 0.5 if setup == "bf16" or planned_batch(the_plan, setup) == 0 else 1.0


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
        # 'compiled': FP8Linear in blocks compiled with CompiledActivations, as the child trains
        "coatstate": Variant("coatstate", "compressed", "compiled", master_bits=24),
        "release": Variant("release", "compressed", "compiled", master_bits=24, gradient_release=True),
        "4bit": Variant(
            "4bit", "compressed", "compiled", master_bits=24, gradient_release=True, moments="4bit"
        ),
    }


def make_plan(cfg: ModelConfig, cap_bytes: float, setups: list[str]):
    """The planner's plan of the same model (traced on the CPU with fake tensors: seconds)."""
    from coatstate.planner import plan, spec_from_factory

    vs = variants()
    spec = spec_from_factory(lambda: Llama(cfg), f"coatstate.models.Llama ({cfg.layers} x {cfg.dim})")
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


def run_child(setup: str, cfg: ModelConfig, args, guess: int, budget_s: float, limit_s: float) -> dict:
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
    res["predicted_max_batch"] = planned_batch(the_plan, setup)
    if res["predicted_max_batch"] is None:
        res["plan_notes"] = the_plan.notes
    else:
        res["predicted_batch1"] = predicted(the_plan, setup, 1)  # (also beside an OOM error)
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
    cfg, params = MODELS[name], param_count(Llama, MODELS[name])
    cap = args.cap_gb * GB if args.cap_gb > 0 else 80 * GB
    t0 = time.perf_counter()
    the_plan = make_plan(cfg, cap, args.setups)
    entry = doc["models"][name] = {
        "config": {**dataclasses.asdict(cfg), "params": params},
        "plan": the_plan.to_dict(),
        "plan_seconds": time.perf_counter() - t0,
        "paper": PAPER.get(name),
        "setups": {},
    }
    shape = f"{params / 1e9:.2f}B params, {cfg.layers} x {cfg.dim}, seq {cfg.seq}"
    print(f"\nLlama {name}: {shape}; planned in {entry['plan_seconds']:.1f} s", flush=True)
    for note in the_plan.notes:
        print(f"  plan note: {note}", flush=True)
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
        guess = max(2, planned_batch(the_plan, setup) or 0)
        # no new probe after 70% of the share: the last probe compiles a new shape and runs steps
        res = run_child(setup, cfg, args, guess, budget_s=0.7 * share, limit_s=min(share + 45, left))
        add_predictions(res, the_plan, setup)
        entry["setups"][setup] = res
        if res["status"] != "ok":
            print(f"{setup:10s} {res['status']}", flush=True)
        write()
        if res["stopped"]:
            raise Stopped("SIGTERM")


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
    from report import section_one_gpu  # the table docs/benchmarks.md shows

    print("\n" + section_one_gpu(doc, out, replan_now=False))
    cap = (doc["meta"].get("memory_cap") or {}).get("cap_bytes") or float("inf")
    for name, entry in doc["models"].items():  # the cap is the allocator's to keep: say so if it did not
        for setup, res in entry["setups"].items():
            runs = [r for r in [res.get("batch1"), *res.get("probes", [])] if r]
            if (over := max((r.get("peak_reserved_bytes", 0) for r in runs), default=0)) > cap:
                print(f"WARNING {name} {setup}: reserved {over / GB:.2f} GB, above the {cap / GB:.0f} GB cap")
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
