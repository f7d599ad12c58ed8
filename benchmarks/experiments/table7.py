"""torchrun --standalone --nproc-per-node 4 benchmarks/experiments/table7.py  # 4 GPUs: COAT's Table 7
torchrun --standalone --nproc-per-node 2 benchmarks/experiments/table7.py --layers 8  # 2 GPUs, 8 layers
torchrun --standalone --nproc-per-node 2 benchmarks/experiments/table7.py --smoke       # tiny, CPU, gloo
python benchmarks/experiments/table7.py --smoke  # the same; starts torchrun itself

COAT's Table 7 (Xi et al. 2024) on Llama-2-7B shapes: memory and speed per GPU under FSDP2.
The model is coatstate.models.Llama at 7B shapes (32 layers, d 4096, 32 heads, SwiGLU 11008,
vocab 32000, seq 2048; random init, no weights), every block and the root fully_shard'ed over
the GPUs present (bf16 compute, fp32 reduce, fp32 master weights), set up as
benchmarks/fsdp_train.py does (its NCCL settings, torchrun launch and gloo --smoke). Setups:
  bf16        nn.Linear in bf16, torch.optim.AdamW(fused=True)
  coatstate   coatstate.convert_to_fp8 (head stays bf16) + compress_activations + CompressedAdamW
  torchao     torchao.float8 convert_to_float8_training (head stays bf16), blocks torch.compile'd,
              torchao AdamWFp8; reported, not fatal, where it does not import or run
  torchao_eager  the same without torch.compile (added by itself when compiled torchao fails)
Per setup, per GPU: optimizer-state GiB (bytes of its state tensors, local shards), activation
GiB (peak allocated minus local params, grads and optimizer state), peak allocated GiB and
tokens/s at --batch (2: the paper's), then the largest batch that fits (doubling, then
bisection to within 1/8, two steps per probe, no new probe after --budget-s seconds) and tokens/s there;
beside the paper's numbers. The paper says GB; we print GiB (2**30 bytes). JSON goes to --out
after every setup; a later run with the same shape and world size (e.g. --setups torchao) adds
its setups to that file instead of dropping the earlier ones.

Out-of-memory probes: every rank runs the same shapes in the same order, so all of them run out
of memory at the same allocation; the ranks then agree (all_reduce) and rebuild model and
optimizer, since FSDP2's state after an exception mid-step is not meant to be reused.
"""

from __future__ import annotations

import os

# Before torch touches CUDA: fewer fragmentation failures in the batch search, same for every setup.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# importing fsdp_train sets its NCCL environment (NVLS and multicast off) before any process group
from common import param_count, result_meta  # noqa: E402
from helpers import log_rank0, token_batch, torchrun_setup  # noqa: E402

import coatstate  # noqa: E402
from coatstate.models import Llama, ModelConfig  # noqa: E402

GIB = 2.0**30
SETUPS = ("bf16", "coatstate", "torchao", "torchao_eager")
# COAT Table 7: Llama-2-7B, seq 2048, 4 GPUs, batch 2 per GPU (COAT's speed at batch 4); GB per GPU.
PAPER = {
    "bf16": dict(
        name="BF16", optimizer_gb=13.1, activation_gb=25.8, peak_gb=55.1, tokens_per_s=7730, batch=2
    ),
    "te": dict(name="TE", peak_gb=51.1, tokens_per_s=9577, batch=2),
    "coat": dict(
        name="COAT", optimizer_gb=3.2, activation_gb=16.9, peak_gb=35.6, tokens_per_s=11257, batch=4
    ),
}
PAPER_OF = {"bf16": "bf16", "coatstate": "coat", "torchao": "te", "torchao_eager": "te"}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="COAT Table 7 on Llama-2-7B shapes under FSDP2")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, gloo, 2 processes")
    p.add_argument("--layers", type=int, default=32, help="Llama-2-7B has 32")
    p.add_argument("--batch", type=int, default=2, help="sequences of 2048 per GPU (the paper's 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps at --batch")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--steps-largest", type=int, default=6, help="timed steps there (after 1)")
    p.add_argument("--max-batch", type=int, default=128, help="the batch search tries nothing above this")
    p.add_argument("--budget-s", type=float, default=150.0, help="per setup: no new batch probe after this")
    p.add_argument("--setups", default="bf16,coatstate,torchao", help=f"comma-separated, of {list(SETUPS)}")
    p.add_argument(
        "--out",
        default=None,
        help="JSON (default benchmarks/experiments/results/table7.json; /tmp/table7_smoke.json with --smoke)",
    )
    args = p.parse_args(argv)
    args.setups = args.setups.split(",")
    unknown = sorted(set(args.setups) - set(SETUPS))
    if unknown:
        p.error(f"unknown --setups {unknown}; choose from {list(SETUPS)}")
    for name in ("layers", "batch", "steps", "max_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.max_batch < args.batch:
        p.error(f"--max-batch ({args.max_batch}) must be at least --batch ({args.batch})")
    if args.smoke:  # --max-batch 6: doubling reaches 4, then the cap ends the search at 6
        args.layers, args.steps, args.warmup, args.steps_largest, args.max_batch = 2, 3, 1, 2, 6
    if args.out is None:
        args.out = "/tmp/table7_smoke.json" if args.smoke else str(HERE / "results" / "table7.json")
    return args


def model_config(args) -> ModelConfig:
    if args.smoke:
        cfg = ModelConfig(vocab=256, dim=64, layers=args.layers, heads=4, hidden=176, seq=64, loss_chunks=2)
    else:
        cfg = ModelConfig(vocab=32000, dim=4096, layers=args.layers, heads=32, hidden=11008, seq=2048)
    return dataclasses.replace(cfg, cast_residual=True)  # (as the benchmarks' Llama was)


# -- memory accounting -------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds on this rank: a DTensor's local shard, a subclass's inner tensors
    (torchao's FP8 states report their logical dtype, not the 1-byte codes they store)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _agree(flag: bool, device: torch.device) -> bool:
    """True on every rank only if it is True on all of them (keeps the ranks in step)."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _is_oom(e: BaseException) -> bool:  # cuBLAS failing to get its workspace is an OOM too
    return isinstance(e, torch.cuda.OutOfMemoryError) or "ALLOC_FAILED" in str(e)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- one setup ---------------------------------------------------------------------------------
def _not_head(module: torch.nn.Module, name: str) -> bool:
    return name != "head"  # the head stays bf16, as in COAT and torchtitan's float8


def _torchao_adamw_fp8():
    try:
        from torchao.optim import AdamWFp8
    except ImportError:  # older torchao
        from torchao.prototype.low_bit_optim import AdamWFp8
    return AdamWFp8


class Trainer:
    """Model, optimizer and forward context of one setup, FSDP2-sharded; rebuilt after an OOM."""

    def __init__(self, setup: str, cfg: ModelConfig, mesh, device: torch.device) -> None:
        self.setup, self.cfg, self.mesh, self.device = setup, cfg, mesh, device
        self.notes: dict = {}
        self.model = self.opt = None
        self.build()

    def build(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch.manual_seed(0)  # the same full model on every rank before it is sharded
        with self.device:
            model = Llama(self.cfg)
        self.ctx = contextlib.nullcontext
        if self.setup == "coatstate":
            coatstate.convert_to_fp8(model, filter_fn=_not_head, min_features=None)
            self.ctx = coatstate.compress_activations
        elif self.setup.startswith("torchao"):
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=_not_head)
            self.notes["compiled"] = self.setup == "torchao" and self.device.type == "cuda"
            if self.notes["compiled"]:
                # one compiled module per block and a few batch sizes: stay under dynamo's recompile limit
                for knob in ("cache_size_limit", "recompile_limit"):
                    if hasattr(torch._dynamo.config, knob):
                        setattr(torch._dynamo.config, knob, 256)
                for i, block in enumerate(model.blocks):
                    model.blocks[i] = torch.compile(block)  # before fully_shard, as torchtitan does
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=self.mesh, mp_policy=mp)
        self.model = fully_shard(model, mesh=self.mesh, mp_policy=mp)
        params = list(self.model.parameters())
        if self.setup == "coatstate":
            self.opt = coatstate.CompressedAdamW(params, lr=3e-4, weight_decay=0.1)
        elif self.setup.startswith("torchao"):
            self.opt = _torchao_adamw_fp8()(params, lr=3e-4, weight_decay=0.1)
        else:
            self.opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=self.device.type == "cuda")
        self.param_bytes = sum(_bytes(p) for p in params)
        self.params = sum(p.numel() for p in params)  # DTensor numel is the global count
        _free(self.device)

    def rebuild(self) -> None:
        self.model = self.opt = None
        _free(self.device)
        self.build()

    def run(self, batch: int, warmup: int, steps: int) -> dict:
        """Median step time over `steps` timed steps after `warmup`; memory on this rank."""
        cuda = self.device.type == "cuda"
        times, losses, grad_bytes = [], [], 0
        for i in range(warmup + steps):
            if i == warmup and cuda:  # steady state: the optimizer state exists by now
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            x, y = token_batch(self.cfg, batch, i, self.device)
            t0 = time.perf_counter()
            with self.ctx():
                loss = self.model(x, y)
            loss.backward()
            if i == warmup + steps - 1:  # grads exist only between backward and zero_grad
                t1 = time.perf_counter()
                grad_bytes = sum(_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
                t0 += time.perf_counter() - t1
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.detach())
        step_s = statistics.median(times)
        out = {
            "batch": batch,
            "step_ms": 1e3 * step_s,
            "tokens_per_s_per_gpu": batch * self.cfg.seq / step_s,
            "loss_last": float(losses[-1]),
            "finite": bool(torch.isfinite(torch.stack(losses)).all()),
            "param_bytes": self.param_bytes,
            "grad_bytes": grad_bytes,
            "optimizer_bytes": optimizer_bytes(self.opt),
        }
        if cuda:
            out["peak_bytes"] = torch.cuda.max_memory_allocated()
            out["reserved_bytes"] = torch.cuda.max_memory_reserved()
            fixed = out["param_bytes"] + grad_bytes + out["optimizer_bytes"]
            out["activation_bytes"] = out["peak_bytes"] - fixed
        return out

    def fits(self, batch: int) -> bool:
        """Two steps at `batch` without running out of memory on any rank."""
        try:
            self.run(batch, warmup=0, steps=2)
            ok = True
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            ok = False
        ok = _agree(ok, self.device)
        if not ok:
            self.rebuild()
        return ok


def largest_batch(fits, start: int, limit: int, time_left) -> tuple[int, list, bool]:
    """(largest batch <= limit that fits, [(batch, fits)], search cut short by time).

    `start` is known to fit. Doubles until a probe fails or the limit is reached, then bisects
    to within 1/8 of the answer (each probe costs two steps at a large batch, a failed one a rebuild).
    `time_left()` is asked before every probe and must answer the same on every rank."""
    lo, hi, grow, probes = start, limit + 1, True, []  # lo fits; hi does not (or is past the limit)
    while hi - lo > (1 if grow else max(1, lo // 8)):
        if not time_left():
            return lo, probes, True
        b = min(2 * lo, hi - 1) if grow else (lo + hi) // 2
        ok = fits(b)
        probes.append((b, ok))
        if ok:
            lo = b
        else:
            hi, grow = b, False
    return lo, probes, False


def _per_gpu(local: dict) -> dict:
    """The same measurement from every rank: worst rank's memory, slowest rank's speed, and lists."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    out = dict(local)
    for key in local:
        if key.endswith("_bytes"):
            out[key] = max(r[key] for r in ranks)
            out[key.replace("_bytes", "_gib_per_rank")] = [r[key] / GIB for r in ranks]
    out["tokens_per_s_per_gpu"] = min(r["tokens_per_s_per_gpu"] for r in ranks)
    out["step_ms"] = max(r["step_ms"] for r in ranks)
    return out


def measure(setup: str, cfg: ModelConfig, args, mesh, device) -> dict:
    t0 = time.perf_counter()
    trainer = Trainer(setup, cfg, mesh, device)
    res = {"params": trainer.params, "notes": trainer.notes}
    res["batch"] = _per_gpu(trainer.run(args.batch, args.warmup, args.steps))
    if setup == "coatstate":  # after a forward: FP8Linear also falls back at run time (and says why)
        res["notes"]["fp8_fallbacks"] = coatstate.nn.fp8_fallbacks(trainer.model)
    log_rank0(f"{setup:14s} batch {args.batch:3d}: {_summary(res['batch'])}")
    deadline = time.perf_counter() + args.budget_s
    best, probes, cut = largest_batch(
        trainer.fits,
        args.batch,
        args.max_batch,
        lambda: _agree(time.perf_counter() < deadline, device),
    )
    res["search"] = {"probes": probes, "cut_short_by_budget": cut, "max_batch": args.max_batch}
    try:
        res["largest"] = _per_gpu(trainer.run(best, 1, args.steps_largest))
        note = " (budget spent)" if cut else ""
        log_rank0(f"{setup:14s} largest batch {best:3d}{note}: {_summary(res['largest'])}")
    except RuntimeError as e:  # fitted twice in the probe, yet not now: keep the rest
        if not _is_oom(e):
            raise
        res["largest_error"] = f"batch {best}: {type(e).__name__}: {e}"
        log_rank0(f"{setup:14s} largest batch {best}: out of memory when timed")
    res["seconds"] = time.perf_counter() - t0
    del trainer
    _free(device)
    return res


def _summary(r: dict) -> str:
    mem = f", peak {r['peak_bytes'] / GIB:6.2f} GiB/GPU" if "peak_bytes" in r else ""
    speed = f"{r['tokens_per_s_per_gpu']:9.0f} tokens/s/GPU, step {r['step_ms']:8.1f} ms"
    return f"{speed}{mem}, loss {r['loss_last']:.3f}" + ("" if r["finite"] else " NON-FINITE LOSS")


# -- the table -----------------------------------------------------------------------------------
def ratios(setups: dict) -> dict:
    """Against bf16: peak memory at the common batch, speed at the common and at each largest batch."""
    base = setups.get("bf16", {})
    out = {}
    for name, r in setups.items():
        if not base.get("batch") or not r.get("batch"):
            continue
        b, s = base["batch"], r["batch"]
        q = {"speed_at_batch": s["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]}
        if "peak_bytes" in s:
            q["peak_reduction_at_batch"] = b["peak_bytes"] / s["peak_bytes"]
        if base.get("largest") and r.get("largest"):
            big, base_big = r["largest"], base["largest"]
            q["speed_at_largest"] = big["tokens_per_s_per_gpu"] / base_big["tokens_per_s_per_gpu"]
        out[name] = q
    return out


def _ours(r: dict, q: dict) -> list[str]:
    """Our column of the table (rows as in `table`)."""
    if "batch" not in r:
        return ["FAILED"] + [""] * 7
    b, big = r["batch"], r.get("largest", {})

    def gib(key):  # tiny (--smoke) sizes still show a number
        return (
            "-" if key not in b else f"{b[key] / GIB:.2f}" if b[key] >= GIB / 100 else f"{b[key] / GIB:.1e}"
        )

    def times(key):
        return f"{q[key]:.2f}x" if key in q else "-"

    return [
        gib("optimizer_bytes"),
        gib("activation_bytes"),
        gib("peak_bytes"),
        f"{b['tokens_per_s_per_gpu']:.0f}",
        str(big.get("batch", "-")),
        f"{big['tokens_per_s_per_gpu']:.0f}" if big else "-",
        times("peak_reduction_at_batch"),
        times("speed_at_largest"),
    ]


def _theirs(p: dict) -> list[str]:
    """The paper's column: its speed sits in the largest-batch rows, at the batch it was measured at."""
    base = PAPER["bf16"]
    return [
        str(p.get("optimizer_gb", "-")),
        str(p.get("activation_gb", "-")),
        str(p["peak_gb"]),
        "-",
        str(p["batch"]),
        str(p["tokens_per_s"]),
        f"{base['peak_gb'] / p['peak_gb']:.2f}x",
        f"{p['tokens_per_s'] / base['tokens_per_s']:.2f}x",
    ]


def table(setups: dict, batch: int) -> str:
    labels = [
        "optimizer state GiB/GPU",
        "activations GiB/GPU",
        "peak GiB/GPU",
        f"tokens/s/GPU at batch {batch}",
        "largest batch",
        "tokens/s/GPU at largest",
        f"peak reduction vs bf16 (b{batch})",
        "speed vs bf16 at largest",
    ]
    q = ratios(setups)
    titles, cols = [], []
    for name in (n for n in SETUPS if n in setups):
        paper = PAPER[PAPER_OF[name]]
        titles += [name, f"paper {paper['name']}"]
        cols += [_ours(setups[name], q.get(name, {})), _theirs(paper)]
    lines = [f"{'':30}" + "".join(f" {t:>13}" for t in titles)]
    lines += [f"{label:30}" + "".join(f" {c[i]:>13}" for c in cols) for i, label in enumerate(labels)]
    lines.append(
        "paper: GB per GPU, 4 GPUs, batch 2; its speeds in the largest-batch rows are at the batch shown "
        "(BF16 and TE 2, COAT 4).\nours: GiB (2**30) of peak allocated memory; the batch search stops at "
        "--max-batch and --budget-s."
    )
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------
def _previous(path: Path, meta: dict) -> dict:
    """Setups of an earlier run of the same shape and world size in `path`, to keep beside ours."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    keys = ("world_size", "machine", "model", "batch", "smoke")
    same = all(old.get("meta", {}).get(k) == meta[k] for k in keys)
    return old.get("setups", {}) if same else {}


def main(argv=None) -> None:
    args = _parse(argv)
    mesh, device = torchrun_setup(args.smoke)
    world, cfg = dist.get_world_size(), model_config(args)
    meta = result_meta(device=str(device)) | {
        "command": "torchrun ... benchmarks/experiments/table7.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "world_size": world,
        "model": {**dataclasses.asdict(cfg), "params": param_count(Llama, cfg)},
        "batch": args.batch,
        "smoke": args.smoke,
        "config": vars(args),
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    log_rank0(
        f"Llama {param_count(Llama, cfg) / 1e9:.3f}B params "
        f"({cfg.layers} layers, d {cfg.dim}, seq {cfg.seq}), "
        f"FSDP2 over {world} x {meta['machine']}, bf16 compute, batch {args.batch} per GPU"
    )
    out = Path(args.out)
    setups = _previous(out, meta) if dist.get_rank() == 0 else {}
    for name in args.setups:
        setups.pop(name, None)
    todo = list(args.setups)
    while todo:
        name = todo.pop(0)
        try:
            setups[name] = measure(name, cfg, args, mesh, device)
        except Exception as e:  # a peer that does not import or run here is reported; the rest still run
            setups[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            log_rank0(f"{name:14s} FAILED: {setups[name]['error']}")
            _free(device)
            compiled_failed = name == "torchao" and not isinstance(e, ImportError)
            if compiled_failed and "torchao_eager" not in args.setups + todo:
                todo.append("torchao_eager")  # compiling may be what failed
        if dist.get_rank() == 0:  # after every setup: a run cut off keeps what it measured
            out.parent.mkdir(parents=True, exist_ok=True)
            doc = {"meta": meta, "paper": PAPER, "setups": setups, "ratios": ratios(setups)}
            out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    log_rank0("\n" + table(setups, args.batch))
    log_rank0(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ and "--smoke" in sys.argv:  # start the two CPU processes ourselves
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", "--nproc-per-node", "2", __file__, *sys.argv[1:]])
    else:
        main()
