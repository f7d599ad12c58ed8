"""python benchmarks/parity_gpu.py --budget-s 530       (one H200; --gpus N to spread the runs)

Training parity on a GPU, for a skeptic: a 100M-parameter byte-level GPT trained on --tokens
(50M) tokens of real Python source per run, under
  adamw          torch.optim.AdamW(fused=True), fp32 parameters: the reference and the noise floor
  compressed     coatstate.CompressedAdamW with the library's defaults
  compressed_ca  + coatstate.CompiledActivations (FP8 saved activations inside the compiled blocks)
  full           + FP8Linear GEMMs (coatstate.convert_to_fp8, the head excluded)
  master24       a bfloat16 model (coatstate.cast_model) with the defaults: master_bits=24
  diagnostics    one deviation each (parity_variants.py): range expansion off / on for one or both
                 moments, master16, compress=False (torch's arithmetic in our step)
  4-bit moments  fp4 (e2m1 m, ue3m1_sqrt v), fp4_v (FP8 m, 4-bit v): options of issue #33
Model: coatstate.models.GPT with GPT-2's init, untied head, 14 blocks of width 768, seq 1024,
rotary positions (--positions learned: results/parity_gpu_learned.json's design). bf16 autocast;
every block torch.compile'd in every variant. AdamW betas (0.9, 0.95), weight decay 0.1 on 2-D
weights, grad clip 1.0, linear warmup then cosine to 10%.
Data (corpus_python.py): the .py files of this Python's stdlib and packages, bytes as tokens, 1%
of the files held out; each batch row a random window whose offset comes from (seed, step), so
every variant at seed s sees adamw:s's batches (the pairing). Recorded per run: train loss and
grad norm every step, validation loss, tokens/s, peak memory, optimizer-state bytes; AdamW runs
also what each FP8 format loses of their final moments (state_reconstruction.py). A run cut by
--budget-s is checkpointed under --ckpt-dir and continued exactly by the next invocation; each
invocation merges into --out, skips finished runs, prints the seed table and draws --png. Runs
sharing a GPU keep their losses but not their tokens/s (`gpu_shared_by`).

    python benchmarks/parity_gpu.py --smoke    # CPU, ~1 min: tiny runs, windows and resume checked
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.monotonic()  # --budget-s counts from here (torch's import included)

import torch  # noqa: E402
from common import result_meta  # noqa: E402
from corpus_python import joined_files, load_corpus, validation_tokens, window_batch  # noqa: E402
from parity_variants import BF16_MODEL, OPTIMIZER_OPTIONS, OPTION_KEYS, RECIPES, VARIANTS  # noqa: E402
from report_common import plot_parity  # noqa: E402
from state_reconstruction import state_reconstruction  # noqa: E402

import coatstate  # noqa: E402
from coatstate.models import GPT, ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()

FINAL_VAL = "every held-out file"
"""The final validation point reads all held-out tokens (whole batches); the curve's points the
first --val-tokens of them (on those alone AdamW's seeds spread too far)."""
SAMPLING = "random windows"
"""Recorded in the config: results of another batch design are refused, never mixed."""
TRAINING_KEYS = (  # the config keys that change what a run computes: runs in one --out must agree
    "layers dim heads seq batch tokens lr warmup min_lr_frac weight_decay clip val_every val_tokens val_pct "
    "max_corpus_mb roots positions"
).split()
SMOKE = dict(device="cpu", layers=2, dim=64, heads=2, seq=64, batch=4, tokens=30 * 256, warmup=5, lr=2e-3)
SMOKE |= dict(val_every=10, val_tokens=4096, log_every=5, roots="stdlib", max_corpus_mb=4, compile="needed")
SMOKE |= dict(
    min_start_s=0, png="", variants="adamw:0,adamw:1,compressed:0,full:0,master24:0,fp4:0"
)
"""--smoke: 2 x 64, 30 steps of 4 x 64 tokens on 4 MiB of the stdlib, about a minute on 2 cores.
(One compiled variant: full compiles what compressed_ca does and FP8Linear too; each compiled run
costs the smoke about 20 s of CI.)"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(f"{v}:{s}" for s in range(3) for v in RECIPES))
    ap.add_argument("--tokens", type=int, default=50_000_000, help="training tokens per run")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument(
        "--positions", choices=["learned", "rope"], default="rope", help="rotary (default) or learned"
    )
    ap.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=150, help="linear warmup steps")
    ap.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine ends at lr * this")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-tokens", type=int, default=2**20)
    ap.add_argument("--val-pct", type=int, default=1, help="files with sha1(path) %% 100 < this validate")
    ap.add_argument("--roots", default="stdlib,purelib,torch", help="corpus roots (sysconfig names, torch)")
    ap.add_argument("--max-corpus-mb", type=float, default=0, help="cap the corpus (0: all of it)")
    ap.add_argument("--log-every", type=int, default=20, help="steps per loss fetch / timing window")
    ap.add_argument("--budget-s", type=float, default=1e9, help="wall budget of this process")
    ap.add_argument("--reserve-s", type=float, default=25, help="kept free for checkpoint + report")
    ap.add_argument("--min-start-s", type=float, default=100, help="start a run only with this much left")
    ap.add_argument("--compile", choices=["all", "needed"], default="all", help="needed: CA variants only")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--device", default="cuda" if CUDA else "cpu")
    ap.add_argument("--cache-dir", default="/tmp/coatstate_corpus")
    ap.add_argument("--ckpt-dir", default=None, help="default /tmp/coatstate_parity_ckpt")
    ap.add_argument("--out", default=None, help="default benchmarks/results/parity_gpu.json")
    ap.add_argument("--png", default=None, help="default docs/img/parity_gpu.png ('' for none)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of everything, with checks")
    ap.add_argument(
        "--report-only", action="store_true", help="only the table and PNG of --out (no training)"
    )
    ap.add_argument("--stop-at", type=int, default=None, help=argparse.SUPPRESS)  # cut each run here
    ap.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)  # --gpus children
    ap.add_argument("--gpu-shared-by", type=int, default=1, help=argparse.SUPPRESS)  # runs per GPU
    ap.add_argument("--smoke-part", action="store_true", help=argparse.SUPPRESS)  # the smoke's resumes
    args = ap.parse_args(argv)
    if args.smoke:  # the flags given still win over these
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
        if not (args.out and args.ckpt_dir):  # a fresh directory for each smoke
            tmp = Path(tempfile.mkdtemp(prefix="coatstate_parity_smoke_"))
            args.out, args.ckpt_dir = args.out or str(tmp / "parity.json"), args.ckpt_dir or str(tmp / "ckpt")
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "parity_gpu.json")
    args.png = str(ROOT / "docs" / "img" / "parity_gpu.png") if args.png is None else args.png
    args.ckpt_dir = args.ckpt_dir or "/tmp/coatstate_parity_ckpt"
    args.runs = [(v, int(s or 0)) for v, _, s in (item.partition(":") for item in args.variants.split(","))]
    if bad := [v for v, _ in args.runs if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    return args


def config(args) -> dict:
    fixed = {"betas": [0.9, 0.95], "eps": 1e-8, "sampling": SAMPLING, "final_val": FINAL_VAL}
    return {k: getattr(args, k) for k in TRAINING_KEYS} | fixed


def left_s(args) -> float:
    return args.budget_s - (time.monotonic() - T0)


# -- model ---------------------------------------------------------------------------------------
def gpt(args) -> GPT:
    """GPT-2 (GPT-2's init, untied head) over bytes, with --positions."""
    cfg = ModelConfig(vocab=256, layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq)
    return GPT(dataclasses.replace(cfg, positions=args.positions, tied=False, gpt2_init=True))


def build(variant: str, seed: int, args, device: torch.device):
    """(model, optimizer, CompiledActivations or None, compiled?) for a variant, seeded."""
    opt_kind, with_ca, with_fp8 = VARIANTS[variant]
    torch.manual_seed(seed)
    model = gpt(args).to(device)
    if with_fp8:
        # every width: the recipe is here to measure FP8's accuracy, and 768 is below the default
        coatstate.convert_to_fp8(model, filter_fn=lambda m, name: name != "head", min_features=None)
    if opt_kind in BF16_MODEL:
        coatstate.cast_model(model)  # bfloat16 weights; the master lives in the optimizer
    ps = list(model.parameters())  # weight decay on matrices (and embeddings), not on norms and biases
    groups = [dict(params=[p for p in ps if p.dim() >= 2], weight_decay=args.weight_decay)]
    groups.append(dict(params=[p for p in ps if p.dim() < 2], weight_decay=0.0))
    kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if opt_kind == "adamw":
        opt = torch.optim.AdamW(groups, fused=device.type == "cuda", **kw)
    else:
        opt = coatstate.CompressedAdamW(groups, **kw, **OPTIMIZER_OPTIONS[opt_kind])
    ca = coatstate.CompiledActivations(**(with_ca if isinstance(with_ca, dict) else {})) if with_ca else None
    compiled = bool(with_ca) or args.compile == "all"
    if compiled:
        for block in model.blocks:
            block.compile(options=ca.options if ca else None)
    return model, opt, ca, compiled


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


# -- checkpoints ---------------------------------------------------------------------------------
def save_ckpt(run_dir: Path, model, opt, record: dict) -> None:
    """Model + optimizer into a new step directory, then latest.json names it (the commit): a cut
    during the save leaves the previous checkpoint whole."""
    step_dir = run_dir / f"step_{record['step']:07d}"
    shutil.rmtree(step_dir, ignore_errors=True)
    step_dir.mkdir(parents=True)
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if CUDA else None}
    if isinstance(opt, coatstate.CompressedAdamW):
        coatstate.save(opt, str(step_dir / "state.safetensors"), model=model)
        torch.save({"rng": rng}, step_dir / "state.pt")
    else:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng}, step_dir / "state.pt")
    (step_dir / "record.json").write_text(json.dumps(record))
    (run_dir / "latest.json.tmp").write_text(json.dumps({"dir": step_dir.name, "step": record["step"]}))
    os.replace(run_dir / "latest.json.tmp", run_dir / "latest.json")
    for old in set(run_dir.glob("step_*")) - {step_dir}:
        shutil.rmtree(old, ignore_errors=True)


def load_ckpt(run_dir: Path, model, opt, cfg: dict) -> dict | None:
    """The run record of the checkpoint in run_dir (model and optimizer restored), or None."""
    if not (run_dir / "latest.json").exists():
        return None
    step_dir = run_dir / json.loads((run_dir / "latest.json").read_text())["dir"]
    record = json.loads((step_dir / "record.json").read_text())
    if record["config"] != cfg:
        raise SystemExit(f"{run_dir} was written with another config; remove it or pass another --ckpt-dir")
    state = torch.load(step_dir / "state.pt", map_location=next(model.parameters()).device)
    if isinstance(opt, coatstate.CompressedAdamW):
        coatstate.load(opt, str(step_dir / "state.safetensors"), model=model)
    else:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"]["cpu"].cpu())  # (no dropout: kept for a model that draws)
    if CUDA and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
    return record


# -- one run ---------------------------------------------------------------------------------------
LISTS = ("train_loss", "grad_norm", "val", "resumed_at", "window_tokens_per_s", "first_window_s")


def curve_tokens(args) -> int:
    """Validation tokens of the curve's points: --val-tokens cut to whole batches."""
    return max(1, args.val_tokens // (args.batch * args.seq)) * args.batch * args.seq


@torch.no_grad()
def evaluate(model, val: torch.Tensor, args, autocast) -> float:
    n, batches = args.batch * args.seq, (len(val) - 1) // (args.batch * args.seq)
    model.eval()
    total = torch.zeros((), device=val.device)
    for k in range(batches):  # eager around compile: no inference graphs to build
        chunk = val[k * n : (k + 1) * n + 1].long()
        with autocast(), torch.compiler.set_stance("force_eager"):
            total += model(chunk[:-1].view(args.batch, -1), chunk[1:].view(args.batch, -1))
    model.train()
    return total.item() / batches


def param_sha256(params) -> str:
    """sha256 of the parameters' bytes (the smoke's bit-exactness check; ctypes: numpy may be absent)."""
    h = hashlib.sha256()
    for p in params:
        t = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def train_run(variant: str, seed: int, args, corpus: dict, val: torch.Tensor) -> dict:
    """Train (or continue) one run until done, --stop-at or the budget; returns its record."""
    device, started = torch.device(args.device), time.monotonic()
    torch._dynamo.reset()  # each run compiles its own graphs (and frees the last run's model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, opt, ca, compiled = build(variant, seed, args, device)
    n, params = args.batch * args.seq, list(model.parameters())
    run_dir, total = Path(args.ckpt_dir) / f"{variant}_{seed}", args.tokens // n
    record = load_ckpt(run_dir, model, opt, config(args))
    if record is None:
        record = dict(variant=variant, seed=seed, status="running", step=0, steps_total=total, tokens=0)
        record |= dict(params=sum(p.numel() for p in params), peak_gib=0.0, wall_s=0.0, config=config(args))
        record |= {k: [] for k in LISTS} | {"device": str(device), "compiled": compiled}
        group = opt.param_groups[0]  # the options as the optimizer resolved them ("auto" is a number now)
        record["optimizer_options"] = {k: group[k] for k in sorted(OPTION_KEYS & set(group))}
    else:
        record["resumed_at"].append(record["step"])
        print(f"{variant}:{seed}: resuming at step {record['step']} of {total}")
    train = joined_files(corpus, validation=False).to(device)  # on the device: windows gathered there
    record["data_passes"] = round(total * n / corpus["stats"]["train_bytes"], 3)
    # runs sharing one GPU keep their losses (the arithmetic is the same) but not their tokens/s
    record["gpu_shared_by"] = max(record.get("gpu_shared_by", 1), args.gpu_shared_by)
    autocast = lambda: torch.autocast(device.type, torch.bfloat16)
    stopped = step_loop(model, opt, record, train, val, args, autocast, params)
    if not stopped and variant == "adamw":  # real fp32 moments: what each FP8 format loses of them
        record["state_reconstruction"] = state_reconstruction(opt)
    states = [t for s in opt.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
    record["opt_state_bytes"] = sum(t.numel() * t.element_size() for t in states)
    if ca is not None:  # what CompiledActivations did to the one graph the blocks share
        st = ca.stats  # (bytes saved for backward by one block, and held of them)
        record["activations"] = dict(graphs=ca.graphs, packed=st.packed, kept=st.kept)
        record["activations"] |= dict(saved=st.activation_bytes_original, held=st.activation_bytes_held)
        policy = ca.policy  # (attention's default changed once; the others are diagnostics' options)
        record["activations"] |= {
            k: getattr(policy, k).value for k in ("attention", "attention_v_out", "norm")
        }
    if device.type == "cuda":
        record["peak_gib"] = max(record["peak_gib"], torch.cuda.max_memory_allocated() / 2**30)
    rates = record["window_tokens_per_s"]
    record["tokens_per_s"] = statistics.median(rates) if rates else None
    record["wall_s"] += time.monotonic() - started
    record["status"] = "partial" if stopped else "done"
    if stopped:
        save_ckpt(run_dir, model, opt, record)
    else:
        record["param_sha256"] = param_sha256(params)
    return record


def step_loop(model, opt, record, train, val, args, autocast, params) -> bool:
    """Steps from record["step"] in windows of --log-every (one loss fetch, one timing each);
    validation between windows. Returns True when stopped early (budget or --stop-at)."""
    n, total, window_s, eval_s, windows = args.batch * args.seq, record["steps_total"], None, 0.0, 0
    stop_at = total if args.stop_at is None else args.stop_at
    while record["step"] < total:
        step = record["step"]
        if step >= stop_at:
            return True
        if window_s is not None and left_s(args) < window_s + eval_s + args.reserve_s:
            print(f"budget: stopping at step {step} ({left_s(args):.0f} s left)")
            return True
        boundaries = [(step // every + 1) * every for every in (args.log_every, args.val_every)]
        end = min(stop_at, total, *boundaries)
        t0, pending = time.perf_counter(), []
        for s in range(step, end):
            for g in opt.param_groups:
                g["lr"] = lr_at(s, total, args)
            rows = window_batch(train, record["seed"], s, args.batch, args.seq)
            with autocast():
                loss = model(rows[:, :-1], rows[:, 1:])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            pending += [loss.detach().float(), norm.detach().float()]
        fetched = torch.stack(pending).view(-1, 2).tolist()  # the one sync of the window
        window_s, windows = time.perf_counter() - t0, windows + 1
        record["train_loss"] += [float(f"{lo:.9g}") for lo, _ in fetched]  # 9 digits: float32 exact
        record["grad_norm"] += [float(f"{g:.4g}") for _, g in fetched]
        record["step"], record["tokens"] = end, end * n
        if windows == 1:  # compilation (and the first steps' allocations) happen in this window
            record["first_window_s"].append(round(window_s, 2))
        elif windows > 2 and end - step == args.log_every:
            record["window_tokens_per_s"].append(round((end - step) * n / window_s))
        if end % args.val_every == 0 or end == total:
            t0 = time.perf_counter()
            part = val if end == total else val[: curve_tokens(args) + 1]  # the final point: all of it
            record["val"].append([end, float(f"{evaluate(model, part, args, autocast):.9g}")])
            eval_s, record["final_val_loss"] = time.perf_counter() - t0, record["val"][-1][1]
            key, loss = f"{record['variant']}:{record['seed']}", record["train_loss"][-1]
            print(f"{key} step {end}/{total}: train {loss:.4f}, val {record['final_val_loss']:.4f}")
    return False


# -- results ---------------------------------------------------------------------------------------
def dumps(obj, pad: str = "") -> str:
    """JSON with one line per list of numbers (a 1500-step loss curve is one line, not 1500)."""
    inner = pad + " "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, dict | list) for v in obj):
        return "[\n" + ",\n".join(inner + dumps(v, inner) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, separators=(",", ":"))


def read_results(out: str | Path) -> dict | None:
    return json.loads(Path(out).read_text()) if Path(out).exists() else None


def merge(args, header: dict, key: str | None = None, record: dict | None = None) -> dict:
    """Read --out, add this invocation (key None) or one run's record, write it back atomically,
    under a lock (--gpus children write the same file). A finished run is never replaced by a
    partial one; runs of another config, corpus or validation set are refused, never mixed."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_results(out) or {**header, "invocations": [], "runs": {}}
        for part in ("config", "corpus", "validation"):
            if data.get(part) != header[part]:
                raise SystemExit(f"{out} holds runs of another {part} ({data.get(part)}); pass another --out")
        data["meta"], data["model"] = header["meta"], header["model"]  # the latest invocation's
        if key is None:
            data["invocations"].append({k: header["meta"][k] for k in ("date", "machine", "command")})
        elif not (data["runs"].get(key, {}).get("status") == "done" and record["status"] != "done"):
            data["runs"][key] = record
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(dumps(data) + "\n")
        os.replace(tmp, out)
    return data


def make_header(args, corpus: dict, val: torch.Tensor) -> dict:
    with torch.device("meta"):
        model = gpt(args)
    meta = result_meta(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "runs"}))
    shape = dict(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, vocab=256, mlp=4)
    shape |= dict(params=sum(p.numel() for p in model.parameters()), positions=args.positions, head="untied")
    shape["block_params"] = sum(p.numel() for p in model.blocks.parameters())
    held_out = {"tokens": len(val) - 1, "batches": (len(val) - 1) // (args.batch * args.seq)}
    held_out["curve_tokens"] = curve_tokens(args)
    return dict(meta=meta, config=config(args), corpus=corpus["stats"], validation=held_out, model=shape)


def run_all(args, corpus: dict, val: torch.Tensor, header: dict, data: dict) -> int:
    """Each requested run not finished yet, in order, until the budget says stop."""
    val = val.to(args.device)
    total = args.tokens // (args.batch * args.seq)
    for variant, seed in args.runs:
        key, run_dir = f"{variant}:{seed}", Path(args.ckpt_dir) / f"{variant}_{seed}"
        old = data["runs"].get(key, {})
        if old.get("status") == "done":
            print(f"{key}: finished before, skipped")
            continue
        if left_s(args) < args.min_start_s:
            print(f"budget: {left_s(args):.0f} s left, not starting {key}")
            break
        if old.get("status") == "partial" and not (run_dir / "latest.json").exists():
            print(f"{key}: its checkpoint is gone from {run_dir}; starting it again")
        record = train_run(variant, seed, args, corpus, val)
        data = merge(args, header, key, record)
        print(f"{key}: {record['status']} at step {record['step']}/{total}, {record['wall_s']:.0f} s")
        if record["status"] == "done":
            shutil.rmtree(run_dir, ignore_errors=True)
        elif args.stop_at is None:
            break  # out of budget
    return 0


def launch(args, argv) -> int:
    """--gpus N: the variant list round-robin over N child processes, one GPU each.
    CUDA_VISIBLE_DEVICES=0,0,0 --gpus 3 puts three on one GPU; their records say so."""
    argv = list(sys.argv[1:] if argv is None else argv)  # the flags appended below win (argparse: last)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.gpus)))).split(",")
    sharing = collections.Counter(visible[: args.gpus])
    procs = []
    for i in range(args.gpus):
        if runs := ",".join(f"{v}:{s}" for v, s in args.runs[i :: args.gpus]):
            flags = ["--gpus", "1", "--no-report", "--budget-s", str(left_s(args)), "--variants", runs]
            flags += ["--gpu-shared-by", str(sharing[visible[i]])]
            flags += ["--out", args.out, "--ckpt-dir", args.ckpt_dir]
            env = os.environ | {"CUDA_VISIBLE_DEVICES": visible[i]}
            procs.append(subprocess.Popen([sys.executable, __file__, *argv, *flags], env=env))
    return max(p.wait() for p in procs)


# -- report ----------------------------------------------------------------------------------------
def report(args) -> None:
    """The seed table and the expansion measure as docs/benchmarks.md shows them, then the PNG."""
    from report import parity_text

    data = read_results(args.out)
    print(parity_text(data, Path(args.out)))
    if partial := [k for k, r in data["runs"].items() if r["status"] != "done"]:
        print(f"unfinished (not in the table): {', '.join(partial)}")
    if args.png:
        try:
            plot_parity(data, Path(args.png))
            print(f"wrote {args.png}")
        except ImportError:
            print("matplotlib is not importable: no PNG written", file=sys.stderr)


# -- smoke -----------------------------------------------------------------------------------------
RESUME_CHECKED = "adamw:0,compressed:0"
"""The smoke runs these again, cut at step 15 and resumed by a second process: each must match
its uninterrupted run; compressed:0 bit for bit (losses, validation points, final parameters).
(full:0 is not among them: its activations hold no state across steps, so its resume is
compressed:0's, and compiling it twice more took about a third of the smoke's 73 s on 2 cores.)"""


def window_problems(corpus: dict, args) -> list[str]:
    """A step's windows come from (seed, step) alone; other seeds and steps draw other windows."""
    train = joined_files(corpus, validation=False)
    draw = lambda seed, step: window_batch(train, seed, step, 8, 64)
    problems = [] if torch.equal(draw(0, 7), draw(0, 7)) else ["two draws of seed 0, step 7 differ"]
    if torch.equal(draw(0, 7), draw(1, 7)) or torch.equal(draw(0, 7), draw(0, 8)):
        problems.append("seeds 0 and 1 (or steps 7 and 8) drew the same windows")
    return problems


def smoke_checks(args, corpus: dict, val: torch.Tensor, header: dict) -> list[str]:
    runs, problems = read_results(args.out)["runs"], window_problems(corpus, args)
    for key in (f"{v}:{s}" for v, s in args.runs):
        r = runs.get(key, {})
        if r.get("status") != "done":
            problems.append(f"{key} did not finish")
        elif (
            not all(map(math.isfinite, r["train_loss"])) or not r["final_val_loss"] < 0.9 * r["train_loss"][0]
        ):
            problems.append(f"{key} did not learn: {r['train_loss'][0]:.3f} -> {r['final_val_loss']}")
    t0 = time.monotonic()
    run_all(args, corpus, val, header, read_results(args.out))  # all finished: nothing may run
    if time.monotonic() - t0 > 5 or read_results(args.out)["runs"] != runs:
        problems.append("a second invocation re-ran or changed finished runs")
    tmp = Path(tempfile.mkdtemp(prefix="parity_resume_"))
    cmd = [sys.executable, __file__, "--smoke", "--smoke-part", "--no-report", "--variants", RESUME_CHECKED]
    cmd += ["--out", str(tmp / "resume.json"), "--ckpt-dir", str(tmp / "ckpt"), "--cache-dir", args.cache_dir]
    cmd += ["--positions", args.positions]
    for extra in (["--stop-at", "15"], []):
        if subprocess.run(cmd + extra).returncode:
            return problems + [f"the resume invocation {extra} failed"]
    resumed = read_results(tmp / "resume.json")["runs"]
    print("\ncut at step 15, resumed by a new process, against the uninterrupted run:")
    for key in RESUME_CHECKED.split(","):
        a, b = runs[key], resumed[key]
        exact = all(a[k] == b[k] for k in ("train_loss", "val", "param_sha256"))
        worst = max(abs(x - y) / abs(x) for x, y in zip(a["train_loss"], b["train_loss"], strict=True))
        print(f"  {key:<16} resumed_at {b['resumed_at']}  bit-exact {exact}  max rel. loss diff {worst:.1e}")
        if b["resumed_at"] != [15] or (key == "compressed:0" and not exact) or worst > 1e-3:
            problems.append(f"{key}: the resumed run does not match the uninterrupted one")
    shutil.rmtree(tmp, ignore_errors=True)
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up in a piped log as they come
    if args.report_only:  # e.g. the PNG where matplotlib is, from a JSON the GPU machine wrote
        return report(args) or 0
    torch.set_float32_matmul_precision("high")
    torch._dynamo.config.recompile_limit = 64  # 14 block instances: never fall back to eager for some
    if args.smoke:  # a tiny model on a small CPU: more threads only add waits (and spin against others)
        torch.set_num_threads(1)
        torch._inductor.config.compile_threads = 1
    corpus = load_corpus(args.roots, args.cache_dir, args.val_pct, args.max_corpus_mb)
    val = validation_tokens(corpus, corpus["stats"]["val_bytes"], args.batch * args.seq)
    header = make_header(args, corpus, val)
    c, m, steps = corpus["stats"], header["model"], args.tokens // (args.batch * args.seq)
    print(f"corpus: {c['total_bytes'] / 2**20:.1f} MiB, {c['files']} files ({c['val_files']} validate)")
    print(
        f"model: {m['layers']} x {m['dim']}, {m['params']:,} params; {steps} steps of {args.batch}x{args.seq}"
    )
    data = merge(args, header)
    rc = launch(args, argv) if args.gpus > 1 else run_all(args, corpus, val, header, data)
    if not args.no_report:
        report(args)
    if args.smoke and not (args.smoke_part or args.no_report):  # the top process checks, once
        problems = smoke_checks(args, corpus, val, header)
        print("\nsmoke: " + ("all checks passed" if not problems else "FAILED\n  " + "\n  ".join(problems)))
        print(f"smoke: {time.monotonic() - T0:.0f} s, results in {args.out}")
        rc = rc or (1 if problems else 0)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
