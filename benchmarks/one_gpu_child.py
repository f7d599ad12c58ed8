"""One setup of benchmarks/one_gpu.py, in a process of its own (that script starts it).

    python benchmarks/one_gpu_child.py --setup coatstate --config '{"dim": 4096, ...}' --out part.json

--out is rewritten after every measurement, so a setup killed at its time limit keeps what it
measured. Setups: bf16 (bf16 weights, fp32 norms, torch AdamW(fused=True) on fp32 masters stepped
a layer at a time: MasterAdamW); coatstate (convert_to_fp8 with the head in bf16, cast_model,
CompressedAdamW(master_bits=24), each block compiled with CompiledActivations' options); release
(the same with gradient_release=True); 4bit (release with 4-bit moments). Batch 1 first, then a
search from the planner's largest batch (--guess), one batch at a time, each probe a warm-up step
and --probe-steps timed steps.
"""

from __future__ import annotations

import os

# Before torch touches CUDA: fewer fragmentation failures in the batch search (as table7.py).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from coatstate.formats.optimizer_state import MASTER_CORRECTION  # noqa: E402
from common import median_range  # noqa: E402

import coatstate  # noqa: E402
from coatstate.models import Llama, ModelConfig  # noqa: E402
from coatstate.nn import convert_to_fp8, fp8_fallbacks  # noqa: E402

SETUPS = ("bf16", "coatstate", "release", "4bit")
FOUR_BIT = dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt")
OPT = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def is_oom(e: BaseException) -> bool:
    """cuBLAS failing to get its workspace is an OOM too, and so is an OOM that dynamo or inductor
    wraps in its own error while compiling a new batch size."""
    text = str(e)
    return (
        isinstance(e, torch.cuda.OutOfMemoryError) or "ALLOC_FAILED" in text or "CUDA out of memory" in text
    )


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class MasterAdamW:
    """COAT's BF16 baseline on one GPU: bf16 weights, fp32 master copies and fp32 moments in
    torch.optim.AdamW(fused=True). One AdamW per layer, stepped in turn, so that the fp32
    gradients the fused kernel needs (it takes one dtype) exist for one layer at a time: 16 bytes
    a parameter plus one layer's fp32 gradients, what the planner counts, not 20 bytes."""

    def __init__(self, model: Llama, owner: Trainer) -> None:
        self.owner = owner
        fused = next(model.parameters()).is_cuda
        chunks = [model.embed, *model.blocks, torch.nn.ModuleList([model.norm, model.head])]
        self.chunks = []
        for i, chunk in enumerate(chunks):
            owner.phase = f"fp32 master weights (layer {i} of {len(chunks)})"
            params = list(chunk.parameters())
            # fp32 parameters (cast_model keeps the norms fp32) are their own master
            masters = [
                p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float()) for p in params
            ]
            self.chunks.append((params, masters, torch.optim.AdamW(masters, fused=fused, **OPT)))

    def step(self) -> None:
        for i, (params, masters, opt) in enumerate(self.chunks):
            self.owner.phase = f"optimizer step (layer {i} of {len(self.chunks)}: fp32 grads, moments)"
            for p, m in zip(params, masters, strict=True):
                if m is not p:
                    m.grad = None if p.grad is None else p.grad.float()
                    p.grad = None
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    if m is not p:
                        p.copy_(m)
                        m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params, masters, _ in self.chunks:
            for t in (*params, *masters):
                t.grad = None

    def split_bytes(self) -> tuple[int, int]:
        """(fp32 master copies, moments)."""
        master = sum(
            nbytes(m for m, p in zip(ms, ps, strict=True) if m is not p) for ps, ms, _ in self.chunks
        )
        states = [
            v for _, _, opt in self.chunks for s in opt.state.values() for k, v in s.items() if k != "step"
        ]
        return master, nbytes(states)


def compressed_split(opt: coatstate.CompressedAdamW) -> tuple[int, int]:
    """(master-correction bytes, moment bytes: codes, scales, exponents, fp32 moments)."""
    corr = moments = 0
    for state in opt.state.values():
        for key, v in state.items():
            if key == "step" or not isinstance(v, torch.Tensor):
                continue
            if key == MASTER_CORRECTION:
                corr += nbytes([v])
            else:
                moments += nbytes([v])
    return corr, moments


class Trainer:
    """Model and optimizer of one setup; `phase` says what it was doing when something failed."""

    def __init__(self, setup: str, cfg: ModelConfig, device: torch.device, simulate_oom_above: int) -> None:
        self.setup, self.cfg, self.device = setup, cfg, device
        self.cuda = device.type == "cuda"
        self.simulate_oom_above = simulate_oom_above
        self.phase = "build model"
        self.notes: dict = {}
        self.graphs = self.model = self.opt = None

    def build(self) -> None:
        """Model and optimizer; separate from __init__ so that `phase` outlives a failure here."""
        setup, cfg, device = self.setup, self.cfg, self.device
        torch.manual_seed(0)
        with device:
            model = Llama(cfg)  # fp32 first: rope tables and init in fp32, then cast
        if setup != "bf16":
            # every width (min_features=None); the head stays bf16, as in COAT and table7.py
            convert_to_fp8(model, filter_fn=lambda m, name: name != "head", min_features=None)
        self.phase = "cast to bf16"
        coatstate.cast_model(model)  # bf16 weights; norms fp32 (their own master)
        if setup != "bf16":
            self.notes["fp8_fallbacks"] = fp8_fallbacks(model)
            # cache=True: the three coatstate setups compile the same block graph, so the later
            # processes take inductor's compiled kernels from its on-disk cache (their stats then
            # say less: the partitioner may not run on a hit); dynamic=False: one static graph per
            # batch size, since CompiledActivations keeps tensors of symbolic shape uncompressed
            self.graphs = coatstate.CompiledActivations(cache=True)
            for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 256)
            for block in model.blocks:
                block.compile(dynamic=False, options=self.graphs.options)
        self.model = model
        self.phase = "optimizer"
        if setup == "bf16":
            self.opt = MasterAdamW(model, self)
        else:
            extra = dict(
                gradient_release=setup in ("release", "4bit"), **(FOUR_BIT if setup == "4bit" else {})
            )
            with warnings.catch_warnings():  # release's warning about clip_grad_norm_: we do not clip
                warnings.simplefilter("ignore")
                self.opt = coatstate.CompressedAdamW(model.parameters(), master_bits=24, **OPT, **extra)
        self.params = sum(p.numel() for p in model.parameters())
        self.param_bytes = nbytes(model.parameters())

    def state_bytes(self) -> dict:
        master, moments = self.opt.split_bytes() if self.setup == "bf16" else compressed_split(self.opt)
        return {"param_bytes": self.param_bytes, "master_bytes": master, "moment_bytes": moments}

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def step(self, x: torch.Tensor, y: torch.Tensor, record: dict) -> torch.Tensor:
        self.phase = "forward"
        if x.shape[0] > self.simulate_oom_above:  # --smoke: the out-of-memory path on a CPU, before
            # the forward so that no new shape is compiled for it
            raise torch.cuda.OutOfMemoryError(
                f"simulated out of memory above batch {self.simulate_oom_above}"
            )
        before = self.allocated()
        loss = self.model(x, y)
        record["activation_bytes"] = self.allocated() - before  # held for backward (and the loss)
        self.phase = "backward" + (" (optimizer steps inside: gradient release)" if self.releasing else "")
        loss.backward()
        record["grad_bytes"] = nbytes(p.grad for p in self.model.parameters() if p.grad is not None)
        self.phase = "optimizer step"
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    @property
    def releasing(self) -> bool:
        return self.setup in ("release", "4bit")

    def recover(self) -> None:
        """After an out-of-memory error mid-step: drop the gradients and end the iteration (with
        release, a parameter stepped in the failed backward would otherwise read as accumulation)."""
        self.opt.zero_grad(set_to_none=True)
        if self.setup != "bf16":
            self.opt.step()  # no gradients: nothing steps; release's bookkeeping starts anew
        free_memory(self.cuda)

    def run(self, batch: int, warmup: int, steps: int) -> dict:
        """Step times (median, min-max over `steps` timed steps after `warmup`) and memory."""
        gen = torch.Generator().manual_seed(batch)
        cfg, sync = self.cfg, (torch.cuda.synchronize if self.cuda else lambda: None)
        data = [
            torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen).to(self.device) for _ in range(2)
        ]
        times, losses, record = [], [], {}
        static = 0
        for i in range(warmup + steps):
            if i == warmup:  # the optimizer state exists by now: the peak of the steady state
                sync()
                free_memory(self.cuda)
                static = self.allocated()
            idx = data[i % 2]
            sync()
            t0 = time.perf_counter()
            losses.append(self.step(idx[:, :-1], idx[:, 1:], record))
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        self.phase = "measured"
        tokens = batch * cfg.seq
        out = {
            "batch": batch,
            "step_s": median_range(times),
            "tokens_per_s": median_range([tokens / t for t in times]),
            "loss_last": float(losses[-1]),
            "finite": bool(torch.isfinite(torch.stack(losses)).all()),
            "activation_bytes": record["activation_bytes"],
            "grad_bytes_after_backward": record["grad_bytes"],
            **self.state_bytes(),
        }
        if self.cuda:
            out["static_bytes"] = static  # allocated before a step: weights, master, moments
            out["peak_bytes"] = torch.cuda.max_memory_allocated()
            out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        return out


def memory_cap(cap_gb: float) -> dict:
    """Cap this process at cap_gb (1e9 bytes) on a larger GPU, so an H200 answers for 80 GB."""
    props = torch.cuda.get_device_properties(0)
    total, cap = props.total_memory, int(cap_gb * 1e9)
    info = {"gpu": props.name, "total_bytes": total, "cap_bytes": None, "fraction": None}
    if cap_gb > 0 and total > cap:
        info["fraction"] = cap / total
        info["cap_bytes"] = cap
        torch.cuda.set_per_process_memory_fraction(info["fraction"])
    return info


def search(fits, known: int, guess: int, limit: int, time_left) -> tuple[int, list, bool]:
    """(largest batch found to fit, probes, cut short by time). `known` fits; the first probe is
    the planner's `guess` (at least known + 1), then one batch at a time up after a fit, down after a failure,
    until a fitting batch sits next to a failing one, the limit is reached or time is up. Each
    probe compiles the blocks for a new static shape, so few probes matter more than bisection."""
    lo, hi, probes = known, limit + 1, []
    b = min(max(guess, lo + 1), limit)
    while lo + 1 < hi and time_left():
        ok = fits(b)
        probes.append((b, ok))
        lo, hi = (b, hi) if ok else (lo, b)
        b = lo + 1 if ok else hi - 1
    return lo, probes, lo + 1 < hi


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=SETUPS, required=True)
    p.add_argument("--config", required=True, help="coatstate.models.ModelConfig fields as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cap-gb", type=float, default=80.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--probe-steps", type=int, default=3)
    p.add_argument("--guess", type=int, default=2, help="first batch the search tries")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=120.0, help="no new batch probe after this")
    p.add_argument(
        "--simulate-oom-above",
        type=int,
        default=1 << 30,
        help="(tests) batch above which backward 'runs out'",
    )
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # (two threads on a shared 2-core host spin against each other)
    res: dict = {"setup": args.setup, "torch": torch.__version__}
    out = Path(args.out)

    def save() -> None:
        res["seconds"] = time.perf_counter() - t_start
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
        os.replace(tmp, out)

    if cuda:
        res["memory"] = memory_cap(args.cap_gb)
    cfg = ModelConfig(**json.loads(args.config))
    trainer = Trainer(args.setup, cfg, device, args.simulate_oom_above)
    try:
        trainer.build()
        res.update(params=trainer.params, notes=trainer.notes)
        res["batch1"] = trainer.run(1, args.warmup, args.steps)
    except RuntimeError as e:
        if not is_oom(e):
            raise
        where = trainer.phase
        res["oom"] = {"batch": 1, "phase": where, "error": str(e).splitlines()[0][:300]}
        if cuda:
            res["oom"]["allocated_bytes"] = torch.cuda.memory_allocated()
        print(f"{args.setup:10s} batch 1: OUT OF MEMORY in {where}", flush=True)
    if trainer.graphs is not None:
        s = trainer.graphs.stats
        res["compiled_activations"] = dict(
            graphs=trainer.graphs.graphs,
            packed=s.packed,
            held_bytes_per_graph=s.activation_bytes_held,
            original_bytes_per_graph=s.activation_bytes_original,
        )
    save()
    if "batch1" not in res:
        return
    b1 = res["batch1"]
    print(f"{args.setup:10s} batch 1: {summary(b1)}", flush=True)
    res["probes"] = []

    def fits(batch: int) -> bool:
        error = None
        try:
            r = trainer.run(batch, 1, args.probe_steps)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            error = f"{trainer.phase}: {str(e).splitlines()[0][:200]}"
        if error is not None:  # (outside the except block: its traceback holds the step's tensors)
            trainer.recover()
            res["probes"].append({"batch": batch, "fits": False, "oom_phase": error})
            print(f"{args.setup:10s} batch {batch}: out of memory ({error[:80]})", flush=True)
        else:
            res["probes"].append({"batch": batch, "fits": True, **r})
            print(f"{args.setup:10s} batch {batch}: {summary(r)}", flush=True)
        save()
        return error is None

    deadline = t_start + args.budget_s
    best, probes, cut = search(fits, 1, args.guess, args.max_batch, lambda: time.perf_counter() < deadline)
    res["search"] = {
        "largest": best,
        "probes": probes,
        "guess": args.guess,
        "max_batch": args.max_batch,
        "cut_short_by_budget": cut,
    }
    save()


def summary(r: dict) -> str:
    tok = r["tokens_per_s"]
    mem = f", peak {r['peak_bytes'] / 1e9:6.2f} GB" if "peak_bytes" in r else ""
    return (
        f"{tok['median']:8.0f} tokens/s [{tok['min']:.0f}-{tok['max']:.0f}]{mem}, loss {r['loss_last']:.3f}"
    )


if __name__ == "__main__":
    main()
