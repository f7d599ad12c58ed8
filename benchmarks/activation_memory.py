"""Activation memory and step time: no compression vs compress_activations vs save_on_cpu.

    python benchmarks/activation_memory.py                 # H200: GPT-2-medium shape, bf16 autocast
    python benchmarks/activation_memory.py --device cpu --layers 2 --seq 128 --batch 2   # smoke test
    python benchmarks/activation_memory.py --compiled      # also with torch.compile'd blocks
    python benchmarks/activation_memory.py --compiled model --out ..._whole_model_compile.json

Variants: no hooks; compress_activations (default policy); the same without recomputing
activation-function outputs; compress_activations with every kind kept (its hooks' own cost:
no kernels run); torch.autograd.graph.save_on_cpu; with --compiled, the model with each block
torch.compile'd, uncompressed, with the context around the compiled calls, and compiled with
coatstate.CompiledActivations' partitioner (FP8 saves inside the graphs, no hooks; its `graph_*`
fields count one compiled graph, i.e. one block, at compile time). --profile DIR also
writes torch.profiler tables of two compress_activations steps (by CUDA and by CPU time) to DIR.

Activation memory = peak allocated during a training step minus what is allocated before it
(params, grads kept allocated by zero_grad(set_to_none=False), AdamW state), from
torch.cuda.max_memory_allocated after reset_peak_memory_stats. Step time = median of --steps
steps after --warmup, timed with CUDA events; host_fwd_ms is the host time to issue the forward
(if it is close to the step time, the step waits on Python, not on the GPU). On CPU there is no
allocator peak: the table shows the saved-activation bytes compress_activations reports instead.

The head and loss run over --loss-chunks chunks of tokens under non-reentrant checkpointing in
every variant (benchmarks/models.py), so the (tokens x 50304) fp32 logits do not dominate the
activation memory of all three; --loss-chunks 1 measures the plain full-logits loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, ModelConfig, add_shape_args  # noqa: E402

from coatstate.activations import CompiledActivations  # noqa: E402
from coatstate.activations import KEEP_ALL  # noqa: E402
from coatstate.activations import compress_activations  # noqa: E402


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", choices=sorted(MODELS), default="gpt")
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-autocast", action="store_true", help="fp32 instead of bf16 autocast")
    p.add_argument("--out", default="benchmarks/results/activation_memory.json")
    p.add_argument("--profile", default=None, help="write torch.profiler tables here")
    p.add_argument(
        "--compiled",
        nargs="?",
        const="blocks",
        choices=["blocks", "model"],
        help="also measure the model with each block torch.compile'd (or, 'model', the whole model "
        "as one graph): uncompressed, and with the context entered outside the compiled calls "
        "(compiled_fp32 kept, the default, and 'bf16')",
    )
    return p.parse_args(argv)


def _contexts():
    return {
        "none": lambda: contextlib.nullcontext(),
        "compress_activations": lambda: compress_activations(),
        "compress, recompute=False": lambda: compress_activations(recompute=False),
        "hooks only (all kept)": lambda: compress_activations(**KEEP_ALL),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
    }


def _compiled_contexts():
    """Variants of the torch.compile'd model (ratios are to its own uncompressed step)."""
    return {
        "compiled: none": lambda: contextlib.nullcontext(),
        "compiled: compress": lambda: compress_activations(),
        "compiled: compress, fp32 bf16": lambda: compress_activations(compiled_fp32="bf16"),
    }


def _step(model, opt, batch, make_ctx, autocast: bool, device: str):
    idx, tgt = batch
    ctx = make_ctx()
    t0 = time.perf_counter()
    with ctx, torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, tgt)
    host_fwd = time.perf_counter() - t0
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss, ctx, host_fwd


def _measure(name, make_ctx, model, opt, batches, args, device):
    cuda = device == "cuda"
    autocast = not args.no_autocast
    for i in range(args.warmup):
        _step(model, opt, batches[i % len(batches)], make_ctx, autocast, device)
    if cuda:
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, host, ctx, loss = [], [], None, None
    for i in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss, ctx, host_fwd = _step(model, opt, batches[i % len(batches)], make_ctx, autocast, device)
        host.append(host_fwd * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    row = {
        "variant": name,
        "step_ms": statistics.median(times),
        "host_fwd_ms": statistics.median(host),
        "loss": float(loss.detach()),
    }
    if cuda:
        row["activation_bytes"] = torch.cuda.max_memory_allocated() - static
        row["static_bytes"] = static
    stats = getattr(ctx, "stats", None)
    if stats is not None:
        row["saved_bytes_original"] = stats.activation_bytes_original
        row["saved_bytes_held"] = stats.activation_bytes_held
        row["recomputed"] = stats.recomputed
        row["kept"] = dict(stats.kept_reasons)
        row["packed_by_kind"] = dict(stats.packed_by_kind)
    return row


def _profile(model, opt, batches, args, device) -> None:
    """torch.profiler tables of two compress_activations steps, by device and by host time, and
    per variant the GPU's busy time against the wall time of the same two steps (busy << wall:
    the GPU waits for the host)."""
    from torch.profiler import ProfilerActivity, profile

    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    autocast = not args.no_autocast
    busy = {}
    variants = {
        "none": contextlib.nullcontext,
        "compress_activations": compress_activations,
        "compress, recompute=False": lambda: compress_activations(recompute=False),
    }
    for name, make in variants.items():
        for i in range(2):  # warm
            _step(model, opt, batches[i], make, autocast, device)
        _sync(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for i in range(2):
                _step(model, opt, batches[i], make, autocast, device)
            _sync(device)
            wall = time.perf_counter() - t0
        averages = prof.key_averages()
        dev = sum(getattr(e, "self_device_time_total", 0) for e in averages) / 1e3
        busy[name] = {"wall_ms_per_step": wall * 500, "device_ms_per_step": dev / 2}
        if name == "compress_activations":
            keys = ["self_cpu_time_total", "cpu_time_total"]
            for key in (["self_device_time_total"] if device == "cuda" else []) + keys:
                table = averages.table(sort_by=key, row_limit=60, max_name_column_width=70)
                (out / f"profile_{key}.txt").write_text(table)
    (out / "busy.json").write_text(json.dumps(busy, indent=1))
    print("profiled (ms per step):", json.dumps(busy))
    import cProfile
    import io
    import pstats

    py = cProfile.Profile()  # Python-level host time (inflated by cProfile, but its split is telling)
    py.enable()
    for i in range(2):
        _step(model, opt, batches[i], compress_activations, autocast, device)
    py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(45)
    (out / "python_tottime.txt").write_text(text.getvalue())
    print(f"wrote profiler tables to {out}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    args = _parse(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --device cpu for a smoke test")
    torch.manual_seed(0)
    cfg = ModelConfig.from_args(args)
    model = MODELS[args.arch](cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    batches = [
        (
            torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device),
            torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device),
        )
        for _ in range(4)
    ]
    rows = [_measure(name, make, model, opt, batches, args, device) for name, make in _contexts().items()]
    if args.compiled:
        # per block, as one should: a graph saves all its tensors when it returns and unpacks them
        # all when its backward starts, so around a whole-model graph the peak cannot drop
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if args.compiled == "model":
            compiled = torch.compile(model)
        else:
            for block in model.blocks:
                block.compile()
            compiled = model
        with warnings.catch_warnings():  # (the default policy warns that float32 saves are kept)
            warnings.simplefilter("ignore", UserWarning)
            for name, make in _compiled_contexts().items():
                rows.append(_measure(name, make, compiled, opt, batches, args, device))
        torch._dynamo.reset()  # recompile the same blocks with the FP8-saving partitioner
        fp8 = CompiledActivations()
        if args.compiled == "model":
            compiled = torch.compile(model, options=fp8.options)
        else:
            for block in model.blocks:
                block.compile(options=fp8.options)
        name = "compiled: CompiledActivations"
        row = _measure(name, contextlib.nullcontext, compiled, opt, batches, args, device)
        row["graph_saved_bytes_original"] = fp8.stats.activation_bytes_original
        row["graph_saved_bytes_held"] = fp8.stats.activation_bytes_held
        row["graph_kept"] = dict(fp8.stats.kept_reasons)
        row["graph_packed_by_kind"] = dict(fp8.stats.packed_by_kind)
        rows.append(row)
    if args.profile:
        _profile(model, opt, batches, args, device)
    print(
        f"{args.arch}: {args.layers} layers, d={args.dim}, seq {args.seq}, batch {args.batch}, "
        f"vocab {args.vocab}, {'fp32' if args.no_autocast else 'bf16 autocast'}, loss chunks "
        f"{args.loss_chunks}, {device}"
    )
    header = f"{'variant':<30} {'act. MiB':>10} {'x none':>8} {'step ms':>9} {'x none':>8} {'host fwd':>9}"
    print(header + "  saved MiB orig->held")
    for r in rows:
        base = rows[0] if not r["variant"].startswith("compiled") else rows[len(_contexts())]
        act = r.get("activation_bytes")
        if act is not None:
            act_s = f"{act / 2**20:10.1f} {act / base['activation_bytes']:8.3f}"
        else:
            act_s = f"{'n/a':>10} {'':>8}"
        saved = ""
        if "saved_bytes_held" in r:
            saved = f"  {r['saved_bytes_original'] / 2**20:.1f} -> {r['saved_bytes_held'] / 2**20:.1f}"
        print(
            f"{r['variant']:<30} {act_s} {r['step_ms']:9.2f} {r['step_ms'] / base['step_ms']:8.3f} "
            f"{r['host_fwd_ms']:9.2f}{saved}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "torch": torch.__version__, "rows": rows}
    if device == "cuda":
        from coatstate.kernels import activation as activation_pack

        result["kernel_launch_mode"] = activation_pack._Launcher.mode
        result["gpu"] = torch.cuda.get_device_name()
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
