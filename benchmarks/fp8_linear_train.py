"""python benchmarks/fp8_linear_train.py --rounds 5 --steps 6 --methods bf16,coatstate_compiled_ca

Training throughput and peak memory of a ~1.06B-parameter Llama (coatstate.models, TinyLlama's
shape, seq 2048) with fp32 master weights under bfloat16 autocast, the head in bf16 throughout:
  bf16[_compiled]  nn.Linear in bf16 + torch AdamW(fused=True) (blocks torch.compile'd)
  torchao[_eager]  torchao.float8.convert_to_float8_training (tensorwise), compiled blocks
  coatstate        convert_to_fp8 + compress_activations + CompressedAdamW, eager
  coatstate_fp8_only  convert_to_fp8 + fused AdamW: the GEMM speedup alone
  coatstate_compiled[_ca]  convert_to_fp8 + CompressedAdamW, compiled blocks (inside
                   compress_activations, entered outside the compiled blocks)
  coatstate_compiled_graphs[_all][_cg][_rel[_b24[_4bit]]]  blocks compiled with CompiledActivations (FP8
                   saves inside the graphs; _all: norm and attention_v_out "group"; _cg: CUDA graphs;
                   _rel: gradient release; _b24: bf16 parameters with a 24-bit master;
                   _4bit: 4-bit moments, e2m1 / ue3m1_sqrt)
  coatstate_compiled_ca_hp  _ca with E4M3 output gradients and a bf16 weight-gradient GEMM
Every method is built at once and timed in interleaved rounds (rounds.py): tokens/s, speedups vs
bf16 paired per round, GPU busy fraction, own peak memory, what compress_activations packed.
--inductor 'coordinate_descent_tuning=1' gives every compiled method those inductor options.
`--smoke` runs tiny on CPU. Writes benchmarks/results/fp8_linear_train_rounds.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

# The same allocator for every method, with fewer fragmentation failures.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from common import param_count  # noqa: E402
from rounds import Variant, inductor_options, run_rounds, spread  # noqa: E402

import coatstate  # noqa: E402
from coatstate.models import Llama, ModelConfig  # noqa: E402
from coatstate.nn import FP8LinearConfig, convert_to_fp8, fp8_fallbacks  # noqa: E402
from coatstate.optim import optimizer_state_bytes  # noqa: E402

GIB = 2.0**30
TINYLLAMA = dict(vocab=32000, dim=2048, layers=18, heads=16, hidden=5632, loss_chunks=8)
METHODS = """bf16 bf16_compiled coatstate_fp8_only coatstate coatstate_compiled coatstate_compiled_ca
coatstate_compiled_graphs coatstate_compiled_graphs_all coatstate_compiled_graphs_cg
coatstate_compiled_graphs_all_cg coatstate_compiled_graphs_rel coatstate_compiled_graphs_rel_b24
coatstate_compiled_graphs_rel_b24_4bit
coatstate_compiled_ca_hp torchao torchao_eager""".split()


def _not_head(module: torch.nn.Module, name: str) -> bool:
    return name != "head"


INDUCTOR_OPTIONS: dict = {}
"""Inductor options every compiled method gets (--inductor), on top of its own."""


def _compile_blocks(model: torch.nn.Module, options: dict | None = None) -> None:
    """torch.compile each transformer block (torchao's recipe; the chunked head/loss stays eager)."""
    options = {**(options or {}), **INDUCTOR_OPTIONS} or None
    # 18 block instances and a few batch sizes: stay above dynamo's recompile limit
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    for block in model.blocks:
        block.compile(options=options)


class _Compressing:
    """A compress_activations factory that keeps the last context, so its stats can be reported."""

    def __init__(self) -> None:
        self.last: coatstate.compress_activations | None = None

    def __call__(self) -> coatstate.compress_activations:
        self.last = coatstate.compress_activations()
        return self.last

    def summary(self) -> dict:
        s = self.last.stats
        mib = dict(mib_original=s.bytes_original / 2**20, mib_packed=s.bytes_packed / 2**20)
        return dict(packed=s.packed, kept=s.kept, kept_reasons=dict(s.kept_reasons), **mib)


# -- the methods -----------------------------------------------------------------------------------
def build(method: str, cfg: ModelConfig, device: torch.device, lr: float = 3e-4):
    """(model, optimizer, forward context factory, notes) for one method, from the same seed."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    fused = device.type == "cuda"
    notes: dict = {}
    no_ctx = contextlib.nullcontext
    if method in ("bf16", "bf16_compiled"):
        if method == "bf16_compiled":  # the fair baseline for the compiled FP8 methods
            _compile_blocks(model)
            notes["compiled"] = True
        return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=fused), no_ctx, notes
    if method in ("torchao", "torchao_eager"):
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=_not_head)
        notes["compiled"] = False
        if device.type == "cuda" and method == "torchao":
            _compile_blocks(model)
            notes["compiled"] = True
        return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=fused), no_ctx, notes
    config = None
    # dx and dW cosine >= 0.999 (experiments/fp8_linear_parity.py --grad-cosine), priced
    if method.endswith("_hp"):
        config = FP8LinearConfig(grad_fmt="e4m3", weight_grad="high_precision")
        notes["fp8_config"] = "grad_fmt e4m3, weight_grad high_precision"
    convert_to_fp8(model, filter_fn=_not_head, config=config)
    notes["fp8_fallbacks"] = fp8_fallbacks(model)
    if method == "coatstate_fp8_only":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=fused), no_ctx, notes
    if "_b24" in method:  # bf16 weights + 1 correction byte (the one-GPU runs' recipe)
        model.to(torch.bfloat16)
    moments = dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt") if method.endswith("_4bit") else {}
    opt = coatstate.CompressedAdamW(model.parameters(), lr=lr, gradient_release="_rel" in method, **moments)
    if method == "coatstate":
        return model, opt, _Compressing(), notes
    if method.startswith("coatstate_compiled_graphs"):
        policy = dict(norm="group", attention_v_out="group") if "_all" in method else {}
        cudagraphs = method.endswith("_cg")  # (inductor leaves CUDA graphs out on CPU, saying so)
        graphs = coatstate.CompiledActivations(**policy, cudagraphs=cudagraphs)
        _compile_blocks(model, graphs.options)
        notes["compiled"] = True
        notes["cudagraphs"] = cudagraphs
        notes["compiled_activations"] = graphs  # (its stats are read after the first step)
        return model, opt, no_ctx, notes
    if method in ("coatstate_compiled", "coatstate_compiled_ca", "coatstate_compiled_ca_hp"):
        _compile_blocks(model)  # on CPU too (--smoke), so the smoke run traces the compiled path
        notes["compiled"] = True
        return model, opt, _Compressing() if "_ca" in method else no_ctx, notes
    raise AssertionError(f"method {method!r} is in METHODS but not built")


def train_step(model, opt, ctx, idx, tgt, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16), ctx():
        loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _graphs_summary(graphs) -> dict:
    s = graphs.stats
    return dict(
        graphs=graphs.graphs,
        packed=s.packed,
        recomputed=s.recomputed,
        mib_saved_per_graph=s.activation_bytes_original / 2**20,
        mib_held_per_graph=s.activation_bytes_held / 2**20,
        kept_reasons=dict(s.kept_reasons),
    )


def measure_interleaved(methods: list[str], cfg, device, args, partial=None) -> dict:
    """--rounds mode: every method built at once and timed in interleaved rounds by
    benchmarks/rounds.py, tokens/s as median [min-max] over rounds, speedups paired per round.
    Own peak = the peak a warm-up step adds to what is allocated before it, plus the method's own
    parameters and optimizer state (the other methods' stay allocated beside it)."""
    g = torch.Generator(device=device).manual_seed(args.batch)
    data = [
        torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device=device, generator=g) for _ in range(2)
    ]
    built, variants, errors = {}, [], {}
    for method in methods:
        try:
            model, opt, ctx, notes = build(method, cfg, device)
        except Exception as e:  # (torchao missing, ...): the others are still measured
            errors[method] = f"{type(e).__name__}: {e}"
            continue
        last = {}

        def step(i, model=model, opt=opt, ctx=ctx, last=last):
            idx = data[i % len(data)]
            last["loss"] = train_step(model, opt, ctx, idx[:, :-1], idx[:, 1:], device)

        before = torch.compiler.cudagraph_mark_step_begin if notes.get("cudagraphs") else None
        variants.append(Variant(method, step, before))
        built[method] = (model, opt, ctx, notes, last)
    cuda = device.type == "cuda"
    summary = run_rounds(
        variants,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        cuda=cuda,
        errors=errors,
        on_round=partial,  # (a cut-off run keeps the rounds it finished)
    )
    results = {m: {"error": e} for m, e in errors.items()}
    tokens = args.batch * cfg.seq
    for method, row in summary.items():
        model, opt, ctx, notes, last = built[method]
        graphs = notes.pop("compiled_activations", None)
        same = dict(
            batch=args.batch,
            step_ms=row["wall_ms"]["median"],
            tokens_per_s=tokens / (row["wall_ms"]["median"] / 1e3),
            tokens_per_s_spread=spread([tokens / (w / 1e3) for w in row["round_wall_ms"]]),
            loss=float(last["loss"]),
            finite=bool(torch.isfinite(last["loss"])),
        )
        if cuda:
            own = sum(p.numel() * p.element_size() for p in model.parameters()) + optimizer_state_bytes(opt)
            same["peak_allocated_gib"] = (row["peak_bytes"] + own) / GIB  # own peak, see above
            same["own_static_gib"] = own / GIB
        results[method] = dict(notes=notes, same_batch=same, rounds=row)
        results[method]["params"] = sum(p.numel() for p in model.parameters())
        if graphs is not None:
            results[method]["compiled_activations"] = _graphs_summary(graphs)
        if isinstance(ctx, _Compressing) and ctx.last is not None:
            results[method]["activations"] = ctx.summary()
    return results


def summarize(results: dict) -> dict:
    """Per method against bf16: the speedup as the median [min-max] of per-round tokens/s ratios,
    and the memory reduction (own peaks, on CUDA)."""
    summary, bf16 = {}, results.get("bf16", {})
    for method, r in results.items() if "rounds" in bf16 else ():
        if "rounds" not in r:
            continue
        walls = zip(bf16["rounds"]["round_wall_ms"], r["rounds"]["round_wall_ms"], strict=False)
        paired = spread([b / m for b, m in walls])
        summary[method] = dict(speedup_vs_bf16=paired["median"], speedup_vs_bf16_spread=paired)
        summary[method] |= dict(gpu_busy=r["rounds"]["busy"], host_bound=r["rounds"]["host_bound"])
        if "peak_allocated_gib" in r["same_batch"]:
            peak, base = r["same_batch"]["peak_allocated_gib"], bf16["same_batch"]["peak_allocated_gib"]
            summary[method] |= dict(own_peak_gib=peak, memory_reduction_vs_bf16=base / peak)
    return summary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--batch", type=int, default=8, help="the common batch (sequences of --seq)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (benchmarks/rounds.py)")
    ap.add_argument(
        "--inductor",
        default="",
        help="inductor options for every compiled method, e.g. 'coordinate_descent_tuning=1'",
    )
    ap.add_argument(
        "--methods",
        default="bf16,bf16_compiled,coatstate_fp8_only,coatstate,coatstate_compiled,coatstate_compiled_ca,"
        "coatstate_compiled_graphs,coatstate_compiled_ca_hp,torchao",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/fp8_linear_train_rounds.json, "
        "/tmp/fp8_linear_train_smoke.json with --smoke)",
    )
    args = ap.parse_args(argv)
    INDUCTOR_OPTIONS.update(inductor_options(args.inductor))

    if args.smoke:
        device = torch.device("cpu")
        cfg = ModelConfig(vocab=256, dim=64, layers=2, heads=2, hidden=176, seq=64, loss_chunks=2)
        args.batch, args.warmup, args.steps = 2, 1, 2
        args.rounds = min(args.rounds, 2)
        torch.set_num_threads(1)  # (two threads on a shared 2-core host spin against each other)
        out = Path(args.out or "/tmp/fp8_linear_train_smoke.json")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (use --smoke for a tiny CPU run)")
        device = torch.device("cuda")
        cfg = ModelConfig(**TINYLLAMA, seq=args.seq)
        out = Path(args.out or Path(__file__).parent / "results" / "fp8_linear_train_rounds.json")
    cfg = dataclasses.replace(cfg, cast_residual=True)  # the residual stream in bf16
    params = param_count(Llama, cfg)
    print(f"Llama-style model, {params / 1e9:.3f}B params, seq {cfg.seq}, {device}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        command="python benchmarks/fp8_linear_train.py " + " ".join(sys.argv[1:] if argv is None else argv),
        model=dict(dataclasses.asdict(cfg), params=params),
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        date=time.strftime("%Y-%m-%d"),
        results={},
    )
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    result["method"] = "rounds"
    result["rounds"] = args.rounds

    def partial(rounds_so_far: dict) -> None:
        out.write_text(json.dumps(dict(result, partial_rounds=rounds_so_far), indent=1) + "\n")

    result["results"] = measure_interleaved(methods, cfg, device, args, partial)
    result["summary"] = summarize(result["results"])
    out.write_text(json.dumps(result, indent=1) + "\n")
    from report import section_fp8_linear_train  # the table docs/benchmarks.md shows

    print(section_fp8_linear_train(result, out) + f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
