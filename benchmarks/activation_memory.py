"""Activation memory and step time: uncompressed vs compress_activations vs CompiledActivations.

    python benchmarks/activation_memory.py --compiled --cudagraphs    # H200: GPT-2-medium shape, bf16
    python benchmarks/activation_memory.py --arch llama --compiled --cudagraphs
    python benchmarks/activation_memory.py --smoke                    # tiny, CPU, a few seconds

Variants (--variants picks a subset): eager `none`; compress_activations (default policy, without
recompute, with every kind kept: the hooks' own cost); identity saved_tensors_hooks (the
mechanism's floor); save_on_cpu. With --compiled each block torch.compile'd (or, 'model', the
whole model): uncompressed, inside compress_activations, and with CompiledActivations' partitioner
(FP8 saves inside the graphs); with --cudagraphs also with CUDA graphs. All variants share one
model (coatstate.models; Llama in its eager layout), optimizer and batches; each compiled variant
swaps its own compiled blocks in. Timing: rounds.py (interleaved rounds, paired per-round ratios
to the uncompressed variant of the same mode, GPU kernel time, host-bound flag). Activation memory
= peak allocated during a warm-up step minus what was allocated before it (on CPU: none). The head
and loss run over --loss-chunks checkpointed chunks of tokens in every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from pathlib import Path

import torch
from common import add_shape_args, result_meta, shape_config
from rounds import Variant, inductor_options, paired, run_rounds

from coatstate.activations import KEEP_ALL, compress_activations
from coatstate.activations.compiled import CompiledActivations
from coatstate.models import MODELS


def _same(x):
    return x


EAGER = {
    "none": contextlib.nullcontext,
    "compress_activations": compress_activations,
    "compress, recompute=False": lambda: compress_activations(recompute=False),
    "hooks only (all kept)": lambda: compress_activations(**KEEP_ALL),
    "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(_same, _same),
    "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
}
COMPILED = {  # name -> (context factory, CompiledActivations policy or None, CUDA graphs)
    "compiled: none": (contextlib.nullcontext, None, False),
    "compiled: compress": (compress_activations, None, False),
    "compiled: compress, fp32 bf16": (lambda: compress_activations(compiled_fp32="bf16"), None, False),
    "compiled: CompiledActivations": (contextlib.nullcontext, {}, False),
    "compiled: CompiledActivations unfused": (contextlib.nullcontext, {"fuse_consumers": False}, False),
}
CUDAGRAPHS = {
    "cudagraphs: none": (contextlib.nullcontext, None, True),
    "cudagraphs: CompiledActivations": (contextlib.nullcontext, {}, True),
    "cudagraphs: CompiledActivations unfused": (contextlib.nullcontext, {"fuse_consumers": False}, True),
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", choices=sorted(MODELS), default="gpt")
    add_shape_args(p)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (benchmarks/rounds.py)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3, help="steps per variant before the rounds")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="no kernel-time step")
    p.add_argument("--no-autocast", action="store_true", help="fp32 instead of bf16 autocast")
    p.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    p.add_argument("--out", default="benchmarks/results/activation_memory.json")
    p.add_argument(
        "--compiled",
        nargs="?",
        const="blocks",
        choices=["blocks", "model"],
        help="also each block torch.compile'd (or, 'model', the whole model as one graph)",
    )
    p.add_argument("--cudagraphs", action="store_true", help="also compiled variants with CUDA graphs")
    p.add_argument(
        "--inductor",
        default="",
        help="inductor options for every compiled variant, uncompressed ones too: "
        "'coordinate_descent_tuning=1,max_autotune_pointwise=1'",
    )
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU, 2 rounds (test)")
    args = p.parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)  # (two threads on a shared 2-core host spin against each other)
        args.device, args.layers, args.dim, args.heads, args.seq, args.batch = "cpu", 2, 64, 2, 64, 2
        args.vocab, args.loss_chunks, args.rounds, args.steps, args.warmup = 256, 2, 2, 2, 1
    if args.cudagraphs and not args.compiled:
        args.compiled = "blocks"
    return args


def _chosen(args) -> dict:
    table = dict(EAGER)
    if args.compiled:
        table |= {n: v for n, v in COMPILED.items()}
    if args.cudagraphs:
        table |= CUDAGRAPHS
    if args.variants:
        names = [n.strip() for n in args.variants.split(",")]
        unknown = [n for n in names if n not in table]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; choose from {list(table)}")
        table = {n: table[n] for n in names}
    return table


def _base_of(name: str, names) -> str:
    for prefix, base in (("compiled:", "compiled: none"), ("cudagraphs:", "cudagraphs: none")):
        if name.startswith(prefix):
            return base if base in names else "none"
    return "none"


def _compile(model, mode: str, policy, cudagraphs: bool, extra: dict):
    """(callable to run the model with, its blocks or None, the CompiledActivations or None)."""
    fp8 = CompiledActivations(**policy, cudagraphs=cudagraphs) if policy is not None else None
    options = fp8.options if fp8 is not None else {"triton.cudagraphs": True} if cudagraphs else {}
    options = {**options, **extra}
    if mode == "model":
        return torch.compile(model, options=options or None), None, fp8
    blocks = torch.nn.ModuleList(torch.compile(b, options=options or None) for b in model.blocks)
    return model, blocks, fp8


class _Runner:
    """One variant's training step on the shared model (its own blocks swapped in)."""

    def __init__(self, model, opt, batches, make_ctx, autocast, device, run=None, blocks=None):
        self.model, self.opt, self.batches, self.make_ctx = model, opt, batches, make_ctx
        self.autocast, self.device = autocast, device
        self.run, self.blocks = run or model, blocks if blocks is not None else model.blocks
        self.ctx = None

    def __call__(self, i: int) -> None:
        idx, tgt = self.batches[i % len(self.batches)]
        self.model._modules["blocks"] = self.blocks  # (no Module.__setattr__ per step)
        self.ctx = self.make_ctx()
        with self.ctx, torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.run(idx, tgt)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)


def _variants(model, opt, batches, args, table: dict):
    """(rounds.Variant list, runners by name, CompiledActivations by name)."""
    autocast, device = not args.no_autocast, args.device
    eager_blocks = model.blocks
    variants, runners, fp8s = [], {}, {}
    for name, spec in table.items():
        if name in EAGER:
            runner = _Runner(model, opt, batches, spec, autocast, device, blocks=eager_blocks)
            before = None
        else:
            make_ctx, policy, cudagraphs = spec
            run, blocks, fp8 = _compile(
                model, args.compiled, policy, cudagraphs, inductor_options(args.inductor)
            )
            runner = _Runner(model, opt, batches, make_ctx, autocast, device, run, blocks or eager_blocks)
            before = torch.compiler.cudagraph_mark_step_begin if cudagraphs else None
            if fp8 is not None:
                fp8s[name] = fp8
        runners[name] = runner
        variants.append(Variant(name, runner, before))
    return variants, runners, fp8s


def _rows(result: dict, runners: dict, fp8s: dict) -> list[dict]:
    rows = []
    for name, r in result.items():
        base = _base_of(name, result)
        row = {
            "variant": name,
            "base": base,
            "step_ms": r["wall_ms"]["median"],  # (the key report.py has always read)
            "wall_ms": r["wall_ms"],
            "event_ms": r["event_ms"],
            "kernel_ms": r["kernel_ms"],
            "host_ms": r["host_ms"],
            "busy": r["busy"],
            "host_bound": r["host_bound"],
            "activation_bytes": r["peak_bytes"],
            "static_bytes": r["allocated_before_bytes"],
            "wall_vs_base": paired(result, name, base),
            "kernel_vs_base": paired(result, name, base, "round_kernel_ms"),
            "wall_vs_eager_none": paired(result, name, "none") if "none" in result else None,
            "round_wall_ms": r["round_wall_ms"],
            "round_kernel_ms": r["round_kernel_ms"],
        }
        if r["peak_bytes"] and result[base]["peak_bytes"]:
            row["activation_vs_base"] = r["peak_bytes"] / result[base]["peak_bytes"]
        stats = getattr(runners[name].ctx, "stats", None)
        if stats is not None:
            row.update(
                saved_bytes_original=stats.activation_bytes_original,
                saved_bytes_held=stats.activation_bytes_held,
                recomputed=stats.recomputed,
                kept=dict(stats.kept_reasons),
                packed_by_kind=dict(stats.packed_by_kind),
            )
        fp8 = fp8s.get(name)
        if fp8 is not None:  # per compiled graph (one block), at compile time
            row.update(
                graph_saved_bytes_original=fp8.stats.activation_bytes_original,
                graph_saved_bytes_held=fp8.stats.activation_bytes_held,
                graph_kept=dict(fp8.stats.kept_reasons),
                graph_packed_by_kind=dict(fp8.stats.packed_by_kind),
            )
        rows.append(row)
    return rows


def _counter(group: str, name: str) -> int:
    """A torch._dynamo counter (dynamo and inductor count compiles, recompiles and CUDA-graph
    skips there)."""
    from torch._dynamo.utils import counters

    return int(counters[group][name]) if group in counters else 0


def _unique_graphs() -> int:
    return _counter("stats", "unique_graphs")


def build(args, table: dict):
    """(model, optimizer, batches) that every variant of `table` shares, from seed 0."""
    device = args.device
    torch.manual_seed(0)
    cfg = shape_config(args, layout="eager")
    model = MODELS[args.arch](cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    batches = [
        tuple(torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device) for _ in range(2))
        for _ in range(4)
    ]
    for p in model.parameters():  # .grad allocated outside any CUDA graph's pool (kept by zero_grad)
        p.grad = torch.zeros_like(p)
    if any(n not in EAGER for n in table):  # 24 block instances, several compiled variants of each
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    return model, opt, batches


def main(argv=None) -> dict:
    args = _parse(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --smoke for a CPU run")
    table = _chosen(args)
    model, opt, batches = build(args, table)
    variants, runners, fp8s = _variants(model, opt, batches, args, table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "meta": result_meta(device=device), "torch": torch.__version__}
    result.update(method="rounds", rows=[])
    if device == "cuda":
        from coatstate.kernels import activation as activation_pack

        result["kernel_launch_mode"] = activation_pack._Launcher.mode
        result["gpu"] = torch.cuda.get_device_name()
    compiled_before = None

    def write(summary: dict) -> None:  # after every round: a cut-off run keeps what it measured
        nonlocal compiled_before
        if compiled_before is None:
            compiled_before = _unique_graphs()
        result["rows"] = _rows(summary, runners, fp8s)
        result["graphs_compiled_during_rounds"] = _unique_graphs() - compiled_before
        result["cudagraph_skips"] = _counter("inductor", "cudagraph_skips")
        out.write_text(json.dumps(result, indent=1))

    with warnings.catch_warnings():  # (the default policy warns that compiled float32 saves are kept)
        warnings.filterwarnings("ignore", message="compress_activations: a torch.compile'd graph")
        if args.smoke:  # (its tensors are below min_numel: the hooks run, nothing is packed)
            warnings.filterwarnings("ignore", message="compress_activations compressed nothing")
        summary = run_rounds(
            variants,
            rounds=args.rounds,
            steps=args.steps,
            warmup=args.warmup,
            cuda=device == "cuda",
            profile=args.profile,
            on_round=write,
        )
    write(summary)
    from report import section_activation_memory  # the table docs/benchmarks.md shows

    print(section_activation_memory(result, out))
    if result["graphs_compiled_during_rounds"]:
        print(f"WARNING: {result['graphs_compiled_during_rounds']} graph(s) compiled after warm-up")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
