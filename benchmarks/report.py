"""python benchmarks/report.py

Renders every kept result in benchmarks/results/*.json: docs/benchmarks.md (one section per
result, PNG figures in docs/img/) and the tables between `<!-- table:NAME -->` markers of
README.md, docs/accuracy.md and docs/performance.md. Each section names the machine and date its
JSON records and the command that wrote it. Needs matplotlib (pip install -e '.[plots]').

Adding a benchmark: its script writes benchmarks/results/NAME.json with common.result_meta() as
"meta"; here one `section_NAME(data, path) -> str` and one line in SECTIONS.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from report_common import (  # machine_meta: importable from here, as the CPU benchmarks did
    DOCS,
    IMG,
    NOISIER,
    RESULTS,
    ROOT,
    _f,
    _figure,
    _md_table,
    _save,
    finished,
    fmt_ci,
    fmt_pct,
    fmt_spread,
    machine_meta,  # noqa: F401
    plot_parity,
    pooled_noise,
    provenance,
    reconstruction_rows,
    source,
    summaries,
)
from report_cpu import section_optimizer_cpu, section_optimizers_cpu_train
from report_one_gpu import missing_one_gpu, section_one_gpu


# ------------------------------------------------------------------------------ optimizer step
def section_optimizer_step(data: dict, path: Path) -> str:
    """optimizer_step.py's interleaved rounds: per-step medians [min-max over rounds]."""
    date, machine = provenance(data, path)
    meta, bw = data["meta"], data["meta"].get("copy_bandwidth_Bps")
    rows = [
        [r["name"], r["dtype"], f"{r['state_bytes_per_param']:.3f}", fmt_spread(r["step_ms_spread"])]
        + [fmt_spread(r["gpu_ms_spread"]), f"{r['floor_ms']:.2f}", f"{r['pipelined_ms'] / r['floor_ms']:.2f}"]
        + [fmt_spread(r["vs_torch"], ".3f", "x"), _f(r.get("first_step_s"))]
        for r in data["rows"]
    ]  # fmt: skip
    head = "optimizer|params dtype|state B/param|step ms|GPU ms|floor ms|x floor|vs torch AdamW|first step s"
    return "\n".join([
        "## Optimizer step (GPU)",
        f"{machine}, {date}, torch {meta.get('torch', '?')}, copy bandwidth measured in the same run "
        f"{_f(bw and bw / 1e12)} TB/s. {meta.get('rounds')} rounds x {meta.get('steps')} samples of steps "
        "run back to back, every optimizer of a dtype built at once and the order rotated per round; per "
        "step, median [min-max over rounds]. GPU ms = kernel time of one profiled sample; floor = bytes "
        "the step must move / copy bandwidth; vs torch AdamW = per-round ratio to torch's fused AdamW. "
        + source(data, path),
        "",
        _md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


def section_whole_state_step(data: dict, path: Path) -> str:
    """whole_state_step.py: bytes per parameter of the whole training state and the step time."""
    m = data["meta"]
    head = "optimizer|weights|correction|grads|moments|total B|with release|floor ms|step ms|spread|first s"
    rows = []
    for r in data["rows"]:
        floor = "" if r["floor_ms"] != r["floor_ms"] else f"{r['floor_ms']:.2f}"  # (NaN: a peer's layout)
        B = [f"{r[k]:.2f}" for k in ("weights_B", "correction_B", "grads_B", "moments_B", "total_B")]
        rows.append([r["name"], *B, f"{r['total_with_release_B']:.2f}", floor, f"{r['step_ms']:.2f}",
                     "{:.2f}-{:.2f}".format(*r["spread_ms"]), f"{r['first_step_s']:.2f}"])  # fmt: skip
    return "\n".join([
        "## The whole training state per parameter (GPU)",
        f"{m['machine']}, {m['date']}, copy bandwidth {m['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, median of "
        f"{m['rounds']} interleaved rounds of {m['steps']} back-to-back steps (spread min-max). `[GxWrR]`: "
        "the fused kernel's launch, G groups of 128 a program, W warps, registers capped at R (none: "
        "ptxas decides); the README shows the kernel's default launch. " + source(data, path),
        "",
        _md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


# --------------------------------------------------------------------------- saved activations
def section_activation_memory(data: dict, path: Path) -> str:
    """activation_memory.py's interleaved rounds: memory, wall and kernel time against the base."""
    date, machine = provenance(data, path)
    args = data["args"]
    shape = ", ".join(f"{k} {args[k]}" for k in ("arch", "layers", "dim", "seq", "batch"))
    rows = [
        [r["variant"], _f(r["activation_bytes"] and r["activation_bytes"] / 1e9),
         _f(r.get("activation_vs_base"), ".3f"), fmt_spread(r["wall_ms"], ".1f"),
         fmt_spread(r["wall_vs_base"], ".3f", "x"), fmt_spread(r["kernel_ms"], ".1f"),
         fmt_spread(r["kernel_vs_base"], ".3f", "x"),
         _f(r["busy"] and r["busy"]["median"]) + (" host-bound" if r["host_bound"] else "")]
        for r in data["rows"]
    ]  # fmt: skip
    head = "variant|activation GB|vs base|wall ms|vs base (wall)|kernel ms|vs base (GPU)|GPU busy"
    return "\n".join([
        f"## Activation memory and step time, {shape}",
        f"{machine}, {date}. {args.get('rounds')} rounds x {args.get('steps')} steps, the variants "
        "interleaved in one process, order rotated per round: median [min-max over rounds]; ratios are "
        "per-round ratios to the row's base (eager `none`, `compiled: none` or `cudagraphs: none`). "
        "Kernel ms = GPU busy time of one profiled step per round; GPU busy = kernel / wall (below 0.9: "
        "host-bound). Activation memory = peak minus what is allocated before a warm-up step. "
        + source(data, path),
        "",
        _md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


def section_fp8_linear_train(data: dict, path: Path) -> str:
    """fp8_linear_train.py --rounds: each FP8 method against bf16, paired per round."""
    date, machine = provenance(data, path)
    model, summary = data["model"], data["summary"]
    rows = [
        [method, f"{r['same_batch']['tokens_per_s']:,.0f}",
         fmt_spread(summary[method].get("speedup_vs_bf16_spread"), suffix="x"),
         f"{r['same_batch']['peak_allocated_gib']:.2f}", _f(summary[method].get("own_peak_gib")),
         _f(summary[method].get("memory_reduction_vs_bf16")) + "x"]
        for method, r in data["results"].items()
    ]  # fmt: skip
    head = "method|tokens/s|speedup vs bf16|peak GiB|own peak GiB|memory reduction vs bf16"
    return "\n".join([
        "## FP8 linear training",
        f"{machine}, {date}, torch {data.get('torch', '?')}. A {model['params'] / 1e9:.2f}B-parameter "
        f"Llama-style model ({model['layers']} layers x {model['dim']}, seq {model['seq']}, batch "
        f"{data['batch']}), fp32 master weights under bf16 autocast, the head in bf16. bf16 = bf16 GEMMs "
        "+ fused AdamW, eager; coatstate_compiled = convert_to_fp8 + CompressedAdamW, blocks compiled; "
        "_graphs: blocks compiled by CompiledActivations (FP8 saved activations inside the graphs); _cg: "
        "with CUDA graphs; _ca: compress_activations around the compiled blocks. "
        f"{data['rounds']} interleaved rounds of {data['steps']} steps: tokens/s = median over rounds, "
        "speedup = median [min-max] of per-round ratios; own peak = what a warm-up step adds plus the "
        "method's own parameters and optimizer state; memory reduction = bf16's own peak / the "
        "method's. " + source(data, path),
        "",
        _md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


# -------------------------------------------------------------------------------- checkpoints
def section_offload(data: dict, path: Path) -> str:
    """offload.py: Llama-2-7B shapes on a GPU capped at 24 GB, optimizer states in host memory."""
    from offload import table  # (imports torch: only when the result exists)

    date, machine = provenance(data, path)
    a = data["meta"]["args"]
    return "\n".join([
        "## Optimizer states in host memory (7B shapes, GPU capped at 24 GB)",
        f"{machine}, {date}, GPU capped at {a['cap_gb']:.0f} GB, batch {a['batch']}, seq 2048, "
        f"{a['rounds']} rounds x {a['steps']} steps: median [min-max]. coatstate: HostOffloadAdamW "
        "(FP8 moments + 24-bit master on the host, its CPU step); torchao: CPUOffloadOptimizer (fp32 "
        "master and moments, torch's fused CPU AdamW). Host states: the optimizer's host bytes; host "
        "buffers: pinned weights and gradients. " + source(data, path),
        "",
        table(data["setups"]),
        "",
    ])  # fmt: skip


def section_checkpoint_io(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    files, real = data["files"], data["stdlib_model"]
    out = [
        "## Checkpoints",
        f"{machine}, {date}. Synthetic {data['params'] / 1e6:.0f}M-parameter GPT-shaped AdamW state "
        "(moments shaped by a few steps of structured gradients). " + source(data, path),
        "",
        _md_table(
            ["file", "MB", "bytes/param", "vs torch.save(AdamW)", "save MB/s", "load MB/s"],
            [[n, f"{r['bytes'] / 1e6:.1f}", f"{r['bytes_per_param']:.3f}",
              f"{r['ratio_vs_torch_adamw']:.3f}x", f"{r['save_MBps']:.0f}", f"{r['load_MBps']:.0f}"]
             for n, r in files.items()],
        ),  # fmt: skip
        "",
        f"zstd on the whole compressed file: {data['zstd_file_gain']:.3f}x; on random FP8 codes "
        f"{data['zstd_random_fp8_gain']['level3']:.3f}x (level 3). A byte-level GPT trained on the "
        f"standard library's source ({real['params'] / 1e6:.2f}M params, {real['steps']} steps), each "
        "optimizer's own state after training:",
        "",
        _md_table(["file", "bytes", "vs torch.save(AdamW)"],
                  [[n, r["bytes"], f"{r['ratio_vs_torch_adamw']:.3f}x"] for n, r in real["files"].items()]),
        "",
        f"zstd gain on that compressed file: {real['zstd_file_gain']:.3f}x; on its FP8 codes (level 3): "
        + ", ".join(f"{m} {g['level3']:.3f}x" for m, g in real["zstd_codes_gain"].items()) + ".",
        "",
    ]  # fmt: skip
    fig, ax, png = _figure("checkpoint_size", "Optimizer checkpoint size per parameter", date, machine)
    ax.barh(list(files), [f["bytes_per_param"] for f in files.values()], color="tab:purple")
    ax.invert_yaxis()
    ax.set_xlabel(f"bytes per parameter ({data['params'] / 1e6:.0f}M-param synthetic state)")
    return "\n".join(out + [_save(fig, png), ""])


# ------------------------------------------------------------------------------------ accuracy
def section_parity_gpu(data: dict, path: Path) -> str:
    """Seed table (mean ± std, vs AdamW's mean, paired 95% interval), the pooled noise, and what
    each FP8 format loses of AdamW's final moments."""
    meta, cfg = data["meta"], data["config"]
    positions = {"rope": "rotary"}.get(cfg.get("positions"), "learned")
    sampling, final = cfg.get("sampling", "one stream"), cfg.get("final_val", "the first held-out tokens")
    png = IMG / f"{path.stem}.png"
    plot_parity(data, png)
    out = [
        f"## Training parity on a GPU, {positions} positions",
        f"{meta['machine']}, {meta['date']}: a {data['model']['params'] / 1e6:.1f}M-param byte-level GPT, "
        f"{cfg['tokens'] / 1e6:.0f}M tokens per run; batches of {sampling}; peak lr {cfg['lr']:g}, "
        f"cosine to {cfg['min_lr_frac']:g} of it; final validation loss on {final}. Source: "
        f"`python benchmarks/parity_gpu.py` (merged over invocations) -> `benchmarks/results/{path.name}`."
        + (f" {meta['note'][0].upper()}{meta['note'][1:]}." if meta.get("note") else ""),
        "",
        "| variant | seeds | val loss mean | std | vs AdamW's mean [95% Welch CI] | paired % [95% CI] | "
        "tokens/s | peak GiB | optimizer MB | max grad norm after 1/5 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    variants = list(dict.fromkeys(x["variant"] for x in data["runs"].values()))
    for r in summaries(data, variants):
        out.append(
            f"| {r['variant']} | {','.join(map(str, r['seeds']))} | {r['mean']:.4f} | "
            f"{_f(r['std'], '.4f', '')} | {fmt_pct(r['vs_adamw_mean_pct'])} {fmt_ci(r['welch_ci_pct'])} | "
            f"{fmt_pct(r['paired_mean_pct'])} {fmt_ci(r['paired_ci_pct'])} | "
            f"{_f(r['tokens_per_s'], ',.0f', '')} | {r['peak_gib']:.1f} | {r['opt_state_mb']:.0f} | "
            f"{_f(r['grad_norm_late_max'])} |"
        )
    if noise := pooled_noise(data, variants):
        out += ["", f"One run's std about its variant's mean, pooled over {noise['runs']} runs "
                f"({noise['dof']} degrees of freedom): {noise['std_pct']:.2f}% of the loss; 3 seeds a side "
                f"resolve a difference of means of ±{noise['resolvable_3_seeds_pct']:.2f}%."]  # fmt: skip
        if left := ", ".join(noise["excluded"]):
            out[-1] += f" Left out as noisier than AdamW (over {NOISIER:g}x its std): {left}."
    heads, recon = reconstruction_rows(data)
    if recon:
        out += ["", "E4M3 groups of 128 on AdamW's final moments, relative squared error; update = "
                "m / (sqrt(v) + eps) with m / v in the formats named:", "",
                _md_table(["seed", *heads], [[s, *(f"{x:.2e}" for x in xs)] for s, xs in recon])]  # fmt: skip
    return "\n".join(out + ["", f"![{png.stem}](img/{png.name})", ""])


SECTIONS = {  # result file stem -> its section of docs/benchmarks.md, in the page's order
    "whole_state_step": section_whole_state_step,
    "optimizer_step": section_optimizer_step,
    "optimizer_cpu": section_optimizer_cpu,
    "optimizers_cpu_train": section_optimizers_cpu_train,
    "offload": section_offload,
    "parity_gpu": section_parity_gpu,
    "parity_gpu_learned": section_parity_gpu,  # docs/accuracy.md: why rotary positions
    "activation_memory": section_activation_memory,
    "activation_memory_llama": section_activation_memory,
    "fp8_linear_train_rounds": section_fp8_linear_train,
    "checkpoint_io": section_checkpoint_io,
    "one_gpu_7b": section_one_gpu,
    "one_gpu_13b": section_one_gpu,
}
MISSING = {"one_gpu_7b": missing_one_gpu, "one_gpu_13b": missing_one_gpu}  # before their (GPU) run


# ---------------------------------------------------------- README and docs tables (markers)
RECIPES = {  # parity_gpu variant: (what a user runs, the bound on its mean vs AdamW's, in percent)
    "compressed": ("`CompressedAdamW` (FP8 moments)", 0.3),
    "master24": ("bf16 model + `CompressedAdamW` (`master_bits=24`)", 0.3),
    "compressed_ca": ("+ `CompiledActivations`", 0.5),
    "full": ("+ `FP8Linear` (the full recipe)", 0.7),
    "fp4": ("`CompressedAdamW`, 4-bit moments (`e2m1` / `ue3m1_sqrt`; opt-in)", 0.3),
    "fp4_v": ("`CompressedAdamW`, FP8 m + 4-bit v (`ue3m1_sqrt`; opt-in)", 0.3),
    "compressed_ca_v_out_group": ('+ `CompiledActivations(attention_v_out="group")` (an option)', 0.5),
    "compressed_ca_norm_group": ('+ `CompiledActivations(norm="group")` (an option)', 0.5),
}
MIN_SEEDS = 3
NOISE_BAR_PCT = 0.6
"""the spread of AdamW's own seeds the accuracy issue asks of the harness"""


def _verdict(row: dict, bound: float) -> str:
    """yes / no only where the 95% Welch interval of the recipe's mean against AdamW's lies wholly
    on one side of its bound; otherwise "not resolved" with the side its mean is on."""
    if len(row["seeds"]) < MIN_SEEDS:
        return f"not decided: {len(row['seeds'])} of {MIN_SEEDS} seeds"
    lo, hi = row["welch_ci_pct"]
    if hi <= bound:
        return "yes"
    if lo > bound:
        return f"no (bound +{bound}%)"
    return f"not resolved (mean {'within' if row['vs_adamw_mean_pct'] <= bound else 'above'} +{bound}%)"


def _head(data: dict, seeds: str) -> str:
    days = sorted({inv["date"][:10] for inv in data["invocations"]} or {data["meta"]["date"][:10]})
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    return (f"{data['meta']['machine']}, {when}: a {data['model']['params'] / 1e6:.0f}M-param byte-level "
            f"GPT, {data['config']['tokens'] / 1e6:.0f}M tokens per run, {seeds}")  # fmt: skip


def accuracy_table(data: dict, short: bool = False) -> str:
    """Per recipe: final validation loss over seeds against AdamW's, memory, and (the long form)
    the spread, the paired interval and whether it keeps AdamW's accuracy."""
    rows = {r["variant"]: r for r in summaries(data, ["adamw", *RECIPES])}
    ref = rows["adamw"]
    if short:
        counts = sorted({len(r["seeds"]) for r in rows.values()})
        seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        head = _head(data, f"{seeds} seeds per recipe; final validation loss in nats/byte, mean ± std.")
        cols = ["recipe", "val loss", "vs AdamW [95% CI]", "bound", "optimizer MB", "peak GiB"]
    else:
        head = _head(data, f"batches of {data['config']['sampling']}; final loss on every held-out file, "
                     f"nats/byte. AdamW's seeds {ref['seeds']}: {ref['mean']:.4f} ± {ref['std']:.4f}: one "
                     f"run's std is {100 * ref['std'] / ref['mean']:.2f}% of the loss, spread "
                     f"{ref['spread_pct']:.2f}% (the harness aims at <= {NOISE_BAR_PCT}%). Each recipe's "
                     "interval is a 95% Welch interval of its mean against AdamW's, from both groups' own "
                     "seeds.")  # fmt: skip
        cols = ["recipe", "seeds", "val loss", "spread", "vs AdamW's mean [95% CI]",
                "paired by seed [95% CI]", "optimizer MB", "peak GiB", "keeps AdamW's accuracy?"]  # fmt: skip
    loss = lambda r: f"{r['mean']:.4f}" + (f" ± {r['std']:.4f}" if r["std"] is not None else "")
    spread = lambda r: _f(r["spread_pct"], ".2f", "") + ("%" if r["spread_pct"] is not None else "")
    mem = lambda r: [f"{r['opt_state_mb']:.0f}", f"{r['peak_gib']:.1f}"]
    adamw = "torch AdamW (fused, fp32)"
    first = [adamw, loss(ref)] if short else [adamw, len(ref["seeds"]), loss(ref), spread(ref)]
    table = [first + ["", "", *mem(ref)] + ([] if short else ["(reference)"])]
    for variant, (label, bound) in RECIPES.items():
        if (r := rows.get(variant)) is None:
            continue
        vs = f"{fmt_pct(r['vs_adamw_mean_pct'])}% {fmt_ci(r['welch_ci_pct'])}"
        if short:
            table.append([label, loss(r), vs, f"+{bound}%", *mem(r)])
        else:
            paired = f"{fmt_pct(r['paired_mean_pct'])}% {fmt_ci(r['paired_ci_pct'])}"
            table.append([label, len(r["seeds"]), loss(r), spread(r), vs, paired, *mem(r)])
            table[-1].append(_verdict(r, bound))
    out = [head, "", _md_table(cols, table)]
    if not short and (line := expansion_line(data)):
        out += ["", line]
    return "\n".join(out)


def expansion_line(data: dict) -> str | None:
    """How many times more plain E4M3 loses of AdamW's real final moments than expanded E4M3."""
    states = [st for r in finished(data, "adamw").values() if (st := r.get("state_reconstruction"))]
    if not states:
        return None
    ratio = {
        "m": [st["moments"]["m"]["plain"] / st["moments"]["m"]["expand"] for st in states],
        "v": [st["moments"]["v"]["plain"] / st["moments"]["v"]["expand"] for st in states],
        "the update m / (sqrt(v) + eps)": [
            st["update"]["plain/plain"]["rel_sq_err"] / st["update"]["expand/expand"]["rel_sq_err"]
            for st in states
        ],
    }
    digits = lambda xs: 1 if max(xs) < 10 else 0
    parts = [f"{min(xs):.{digits(xs)}f}-{max(xs):.{digits(xs)}f}x more of {w}" for w, xs in ratio.items()]
    return (
        f"On the final float32 moments of these {len(states)} AdamW runs, E4M3 groups of 128 without range "
        f"expansion lose (in squared error) {', '.join(parts)} than with expansion on both moments."
    )


WHOLE_STATE_ROWS = {  # whole_state_step.json row name (at the kernel's default launch): README label
    "torch AdamW fused, fp32 params": "torch AdamW fused, fp32 params",
    "FlashOptim FlashAdamW, bf16, master 24": "FlashOptim 0.1.4, bf16, 24-bit master",
    "torchao AdamW4bit, bf16 params (no master)": "torchao 0.18 AdamW4bit, bf16, no master",
    "coatstate CompressedAdamW, fp32 params": "**coatstate**, fp32 params",
    "coatstate CompressedAdamW, bf16, master_bits=24": "**coatstate**, bf16, `master_bits=24` (bf16 default)",
    "coatstate CompressedAdamW, bf16, master_bits=24, 4-bit moments": "**coatstate**, bf16, 24-bit master, "
    '4-bit moments (`"e2m1"` / `"ue3m1_sqrt"`, opt-in)',
    "coatstate CompressedAdamW, bf16, master_bits=24, FP8 m + 4-bit v": "**coatstate**, bf16, 24-bit master, "
    'FP8 m + 4-bit v (`"ue3m1_sqrt"`, opt-in)',
}


def _default_launch_name(name: str) -> str:
    """A row timed under --configs is named "... [GxWrR]": the plain name at the kernel's default
    launch, "" at the others."""
    from coatstate.kernels.adamw_fused import GROUPS_PER_PROGRAM, MAX_REGISTERS, NUM_WARPS

    base, _, config = name.partition(" [")
    default = f"{GROUPS_PER_PROGRAM}x{NUM_WARPS}" + (f"r{MAX_REGISTERS}" if MAX_REGISTERS else "")
    return base if not config or config == f"{default}]" else ""


def headline_table(whole: dict, activations: dict, checkpoint: dict) -> str:
    """Whole training state per parameter and step time on the 1.31B set; activation memory and
    checkpoint size in one line each."""
    m = whole["meta"]
    out = [
        f"Optimizer step, {m['machine']}, {m['date']}, 1.31B GPT-shaped params, median of {m['rounds']} "
        "interleaved rounds [min-max]; bytes per parameter of weights + master correction + gradients + "
        "moments; floor = bytes the step must move / copy bandwidth. coatstate's FP8 moments at the "
        "defaults (range expansion on for both).",
        "",
        "| optimizer | state B/param | with gradient release | step ms | floor ms |",
        "|---|---|---|---|---|",
    ]
    rows = {_default_launch_name(r["name"]): r for r in whole["rows"]}
    for name, label in WHOLE_STATE_ROWS.items():
        r = rows[name]
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] == r["floor_ms"] else ""  # NaN: the peer's layout
        out.append(f"| {label} | {r['total_B']:.2f} | {r['total_with_release_B']:.2f} | {r['step_ms']:.2f} "
                   "[{:.2f}-{:.2f}] | {} |".format(*r["spread_ms"], floor))  # fmt: skip
    act = next(r for r in activations["rows"] if r["variant"] == "cudagraphs: CompiledActivations")
    wall, am = act["wall_vs_base"], activations["meta"]
    out += ["", f"Saved activations (GPT-2-medium shape, {am['machine']}, {am['date'][:10]}, "
            f"`CompiledActivations(cudagraphs=True)`): **{act['activation_vs_base']:.2f}x** the memory at "
            f"{wall['median']:.3f}x [{wall['min']:.3f}-{wall['max']:.3f}] the step's wall time. "
            f"Checkpoints: `coatstate.save` of a {checkpoint['params'] / 1e6:.0f}M-param state is "
            f"**{checkpoint['ratio_compressed_vs_torch_adamw']:.3f}x** the bytes of "
            "`torch.save(AdamW.state_dict())`."]  # fmt: skip
    return "\n".join(out)


ACTIVATION_ROWS = {  # activation_memory.json variant: what a user runs
    "compress_activations": "eager, `compress_activations()`",
    "compiled: CompiledActivations": "compiled blocks, `CompiledActivations()`",
    "cudagraphs: CompiledActivations": "compiled blocks, `CompiledActivations(cudagraphs=True)`",
}
FP8_METHODS = {  # fp8_linear_train_rounds.json method: what a user runs (the first: the recipe)
    "coatstate_compiled_graphs": "",
    "coatstate_compiled": "without saved-activation compression (compiled `FP8Linear` + `CompressedAdamW`)",
    "coatstate_compiled_graphs_cg": "with `CompiledActivations(cudagraphs=True)`",
    "coatstate_compiled_ca": "with `compress_activations()` around the compiled blocks instead, which cannot "
    "see op kinds there and packs every 16-bit saved tensor in FP8 groups, attention's q and k included "
    "(kept by default for accuracy)",
}


def activations_table(gpt: dict, llama: dict, fp8: dict) -> str:
    """Each saved-activation recipe against the same step without it, per model; the FP8 recipe
    against bf16 below."""
    meta, args = gpt["meta"], gpt["args"]
    out = [
        f"Saved activations, {meta['machine']}, {meta['date'][:10]}, inductor's defaults (no tuning flags), "
        f"bf16 autocast, batch {args['batch']} x seq {args['seq']}; median of {args['rounds']} interleaved "
        "rounds [min-max], each ratio against the same model run the same way without compression (eager, "
        "compiled, or compiled with CUDA graphs). GPU = the step's kernel time.",
        "",
        "| model | recipe | activation memory | wall time | GPU time |",
        "|---|---|---|---|---|",
    ]
    for data in (gpt, llama):
        a, rows = data["args"], {r["variant"]: r for r in data["rows"]}
        name = f"{'GPT' if a['arch'] == 'gpt' else 'Llama'}, {a['layers']} x {a['dim']}"
        for variant, label in ACTIVATION_ROWS.items():
            r = rows[variant]
            wall, gpu = (fmt_spread(r[k], ".3f", "x") for k in ("wall_vs_base", "kernel_vs_base"))
            out.append(f"| {name} | {label} | {r['activation_vs_base']:.3f}x | {wall} | {gpu} |")
    s, m = fp8["summary"], fp8["model"]

    def figure(method: str) -> str:
        sp = s[method]["speedup_vs_bf16_spread"]
        return (f"**{sp['median']:.2f}x** [{sp['min']:.2f}-{sp['max']:.2f}] bf16's tokens/s at "
                f"**{s[method]['memory_reduction_vs_bf16']:.2f}x** less peak memory")  # fmt: skip

    recipe, *others = FP8_METHODS
    out += ["", f"The FP8 recipe (compiled `FP8Linear` + `CompiledActivations` + `CompressedAdamW`, the "
            f"parity harness's `full`) on a {m['params'] / 1e9:.2f}B Llama ({m['layers']} x {m['dim']}, seq "
            f"{m['seq']}, batch {fp8['batch']}), {fp8['device']}, {fp8['date']}, {fp8['rounds']} rounds at "
            f"inductor's defaults: {figure(recipe)}."]  # fmt: skip
    return "\n".join(out + [f"- {FP8_METHODS[k]}: {figure(k)}." for k in others if k in s])


def one_gpu_line(seven: dict, thirteen: dict) -> str:
    """The README's measured answer to "how many GPUs?": one_gpu.py's 7B and 13B runs (7B: the
    default recipe; 13B: the setup with the lowest peak)."""
    labels = {"coatstate": "the FP8 recipe", "release": "+ gradient release", "4bit": "+ release, 4-bit moments"}
    s7 = seven["models"]["7b"]["setups"]["coatstate"]["batch1"]
    ok13 = [(k, v["batch1"]) for k, v in thirteen["models"]["13b"]["setups"].items() if v.get("batch1")]
    k13, s13 = min(ok13, key=lambda kv: kv[1]["peak_bytes"])
    fig = lambda r: f"{r['peak_bytes'] / 1e9:.1f} GB, {r['tokens_per_s']['median']:,.0f} tokens/s"  # noqa: E731
    return (f"one {seven['meta']['machine']} capped at 80 GB, seq 2048, batch 1: Llama-2-7B {fig(s7)} "
            f"({labels['coatstate']}), Llama-2-13B {fig(s13)} ({labels[k13]}); bf16 + torch AdamW runs "
            "out of memory on both. COAT's Table 7: 7B at 79.3 GB and 5,906 tokens/s, 13B needs 2 GPUs.")


def tables() -> dict[str, str]:
    """{marker name: markdown} of every generated table of the README and docs pages."""
    load = lambda name: json.loads((RESULTS / f"{name}.json").read_text())
    parity = load("parity_gpu")
    return {
        "accuracy": accuracy_table(parity),
        "accuracy-summary": accuracy_table(parity, short=True),
        "headline": headline_table(*map(load, ("whole_state_step", "activation_memory", "checkpoint_io"))),
        "one-gpu": one_gpu_line(load("one_gpu_7b"), load("one_gpu_13b")),
        "activations": activations_table(
            load("activation_memory"), load("activation_memory_llama"), load("fp8_linear_train_rounds")
        ),
    }


DOCS_WITH_TABLES = ("README.md", "docs/accuracy.md", "docs/performance.md")
"""The hand-written pages that hold generated tables between markers."""


def marked_blocks(text: str) -> dict[str, str]:
    """{name: the text between <!-- table:NAME --> and <!-- /table:NAME -->} of a page."""
    return dict(re.findall(r"<!-- table:([\w-]+) -->\n(.*?)<!-- /table:\1 -->", text, re.S))


def update_readme(pages: tuple[str, ...] = DOCS_WITH_TABLES) -> list[str]:
    """Rewrite each marked block of the README and the docs pages; returns them as page:name."""
    written, generated = [], tables()
    for page in pages:
        path = ROOT / page
        text = path.read_text()
        for name, table in generated.items():
            pattern = re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.S)
            if pattern.search(text):
                text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
                written.append(f"{page}:{name}")
        path.write_text(text)
    return written


def page() -> str:
    """docs/benchmarks.md: a section per SECTIONS entry (its figures written to IMG)."""
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from the JSON in `benchmarks/results/`; do not edit "
        "by hand. One section per kept result, each naming the machine, date and command it comes from. "
        "One-off experiments and what they found: `benchmarks/experiments/README.md`.",
        "",
    ]
    for name, section in SECTIONS.items():
        path = RESULTS / f"{name}.json"
        parts.append(section(json.loads(path.read_text()), path) if path.exists() else MISSING[name](name))
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("benchmarks/report.py needs matplotlib: pip install -e '.[plots]'", file=sys.stderr)
        return 1
    (DOCS / "benchmarks.md").write_text(page())
    if unknown := sorted(p.name for p in RESULTS.glob("*.json") if p.stem not in SECTIONS):
        print(f"results without a section (add one to SECTIONS): {', '.join(unknown)}", file=sys.stderr)
    print(f"wrote {(DOCS / 'benchmarks.md').relative_to(ROOT)} and figures in {IMG.relative_to(ROOT)}/")
    print(f"README tables rewritten: {', '.join(update_readme())}")
    return 1 if unknown else 0


if __name__ == "__main__":
    raise SystemExit(main())
