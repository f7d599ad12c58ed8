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

from report_common import (
    DOCS,
    IMG,
    NOISIER,
    RESULTS,
    ROOT,
    finished,
    fmt_ci,
    fmt_num,
    fmt_pct,
    fmt_spread,
    md_table,
    optimizers_cpu_train_table,
    plot_parity,
    pooled_noise,
    provenance,
    reconstruction_rows,
    source,
    summaries,
)


def _figure(name: str, title: str, date: str, machine: str, nrows: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(nrows, 1, figsize=(8, 4.5 if nrows == 1 else 6.5), sharex=True, squeeze=True)
    fig.suptitle(title, fontsize=11)
    fig.text(0.99, 0.01, f"{machine} · {date}", ha="right", va="bottom", fontsize=7, color="0.35")
    return fig, ax, IMG / f"{name}.png"


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long bar labels stay whole
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"![{path.stem}](img/{path.name})"


# ------------------------------------------------------------------------------ optimizer step
def section_optimizer_step(data: dict, path: Path) -> str:
    """optimizer_step.py's interleaved rounds: per-step medians [min-max over rounds]."""
    date, machine = provenance(data, path)
    meta, bw = data["meta"], data["meta"].get("copy_bandwidth_Bps")
    rows = [
        [r["name"], r["dtype"], f"{r['state_bytes_per_param']:.3f}", fmt_spread(r["step_ms_spread"])]
        + [fmt_spread(r["gpu_ms_spread"]), f"{r['floor_ms']:.2f}", f"{r['pipelined_ms'] / r['floor_ms']:.2f}"]
        + [fmt_spread(r["vs_torch"], ".3f", "x"), fmt_num(r.get("first_step_s"))]
        for r in data["rows"]
    ]  # fmt: skip
    head = "optimizer|params dtype|state B/param|step ms|GPU ms|floor ms|x floor|vs torch AdamW|first step s"
    return "\n".join([
        "## Optimizer step (GPU)",
        f"{machine}, {date}, torch {meta.get('torch', '?')}, copy bandwidth measured in the same run "
        f"{fmt_num(bw and bw / 1e12)} TB/s. {meta.get('rounds')} rounds x {meta.get('steps')} samples of "
        "steps run back to back, every optimizer of a dtype built at once and the order rotated per "
        "round; per step, median [min-max over rounds]. GPU ms = kernel time of one profiled sample; "
        "floor = bytes the step must move / copy bandwidth; vs torch AdamW = per-round ratio to torch's "
        "fused AdamW. "
        + source(data, path),
        "",
        md_table(head.split("|"), rows),
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
        md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


# --------------------------------------------------------------------------- saved activations
def section_activation_memory(data: dict, path: Path) -> str:
    """activation_memory.py's interleaved rounds: memory, wall and kernel time against the base."""
    date, machine = provenance(data, path)
    args = data["args"]
    shape = ", ".join(f"{k} {args[k]}" for k in ("arch", "layers", "dim", "seq", "batch"))
    rows = [
        [r["variant"], fmt_num(r["activation_bytes"] and r["activation_bytes"] / 1e9),
         fmt_num(r.get("activation_vs_base"), ".3f"), fmt_spread(r["wall_ms"], ".1f"),
         fmt_spread(r["wall_vs_base"], ".3f", "x"), fmt_spread(r["kernel_ms"], ".1f"),
         fmt_spread(r["kernel_vs_base"], ".3f", "x"),
         fmt_num(r["busy"] and r["busy"]["median"]) + (" host-bound" if r["host_bound"] else "")]
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
        md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


def section_fp8_linear_train(data: dict, path: Path) -> str:
    """fp8_linear_train.py --rounds: each FP8 method against bf16, paired per round."""
    date, machine = provenance(data, path)
    model, summary = data["model"], data["summary"]
    rows = [
        [method, f"{r['same_batch']['tokens_per_s']:,.0f}",
         fmt_spread(summary[method].get("speedup_vs_bf16_spread"), suffix="x"),
         fmt_num(r["same_batch"].get("peak_allocated_gib")), fmt_num(summary[method].get("own_peak_gib")),
         fmt_num(summary[method].get("memory_reduction_vs_bf16")) + "x"]
        for method, r in data["results"].items() if method in summary
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
        md_table(head.split("|"), rows),
        "",
    ])  # fmt: skip


# ------------------------------------------------------------------------------ CPU optimizers
REFERENCE = "torch AdamW fused=True"


def _cpu_table(run: dict) -> str:
    rows = []
    for name, r in run["rows"].items():
        ns, floor = r["ns_per_param"], r["floor_ns_per_param"]
        rows.append([
            name, f"{r['state_bytes_per_param']:.2f}", f"{r['bytes_moved_per_param']:.1f}", fmt_spread(ns),
            f"{r['vs_reference']:.2f}x", f"{floor:.2f}", f"{ns['median'] / floor:.1f}",
        ])  # fmt: skip
    head = "optimizer|state B/param|moved B/param|ns/param|vs fused|floor ns/param|x floor"
    return md_table(head.split("|"), rows)


def _cpu_vs_gpu(data: dict) -> str:
    """The seed question's paragraph: the ratios here beside the H200's (docs: optimizer_step)."""
    runs = data["by_threads"]
    threads = "2" if "2" in runs else next(iter(runs))
    rows = runs[threads]["rows"]

    def x_floor(name: str) -> float:
        r = rows.get(name)
        return r["ns_per_param"]["median"] / r["floor_ns_per_param"] if r else float("nan")

    def vs(name: str) -> float:
        return rows[name]["vs_reference"] if name in rows else float("nan")

    plain, dflt = "coatstate plain E4M3", "coatstate defaults (FP8, expansion)"
    return (
        "**What changes on a CPU.** On the H200 the FP8 step moves 16.2 bytes a parameter against fused "
        "AdamW's 28 and runs at 0.50x (expansion off) to 0.55x (on) of its time, close to the bytes "
        "ratio: the GPU has arithmetic to spare, so both steps sit near the copy-bandwidth floor "
        f"(1.06-1.24x it). Here, at {threads} thread(s), torch's fused AdamW runs at "
        f"{x_floor(REFERENCE):.1f}x its floor, while the compressed steps run at {x_floor(plain):.1f}x "
        f"(plain E4M3, {vs(plain):.2f}x torch's time) and {x_floor(dflt):.1f}x (range expansion, "
        f"{vs(dflt):.2f}x): two cores cannot decode, update and re-encode a parameter as fast as memory "
        "delivers its 16 bytes. The step is compute-bound on a small CPU: the sqrt and two true "
        "divisions of the update (which torch pays too) plus the codec, and with expansion a log2 and "
        "two exp2 per moment element, each a float32 polynomial that must round as the format defines. "
        "The memory saving (8 -> 2.1 bytes a parameter of state) is the same on both machines; on the "
        "CPU it costs step time instead of saving it, unless there are enough cores per memory channel "
        "for the floor, not the arithmetic, to set the time."
    )


def section_optimizer_cpu(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    meta = data["meta"]
    out = [
        "## Optimizer step (CPU)",
        f"{machine}, {date}, torch {meta.get('torch', '?')}; {data['params'] / 1e6:.1f}M GPT-shaped fp32 "
        f"params in {data['tensors']} tensors, random gradients. Every variant lives in memory at once "
        "and they take turns, in an order rotated per round; ns/param = median [min-max] over the "
        "rounds of each round's median step. Moved = bytes a step must read and write; floor = moved / "
        "this machine's in-place bandwidth (an `add_`'s read + write). Source: "
        "`python benchmarks/optimizer_cpu.py` -> `benchmarks/results/optimizer_cpu.json`.",
        "",
    ]
    for threads, run in data["by_threads"].items():
        first = run.get("first_step_s", {})
        out += [
            f"**{threads} thread(s)**: in-place bandwidth "
            f"{run['inplace_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"{run['rounds']} rounds of {run['steps_per_round']} steps; first step of a fresh process "
            f"(the C++ step built and loaded): {first.get('cold', float('nan')):.1f} s with an empty cache, "
            f"{first.get('warm', float('nan')):.2f} s with it warm.",
            "",
            _cpu_table(run),
            "",
        ]
    return "\n".join(out + [_cpu_vs_gpu(data), ""])


def section_optimizers_cpu_train(data: dict, path: Path) -> str:
    """CompressedSGD, CompressedLion and CompressedMuon against their references on CPU."""
    date, machine = provenance(data, path)
    a = data["meta"]["args"]
    return "\n".join(
        [
            "## SGD, Lion and Muon on CPU",
            f"{machine}, {date}, torch {data['meta'].get('torch', '?')}: a byte-level GPT ({a['layers']} "
            f"layers, width {a['dim']}, seq {a['seq']}, batch {a['batch']}) trained {a['steps']} steps on "
            f"the standard library's sources, {a['seeds']} seeds per variant (the same init and batches "
            "on both sides of a seed); final loss on held-out files (nats/byte). Default formats (FP8 "
            "E4M3 with range expansion); state bytes per parameter of the optimizer compared, 1-D and "
            "small tensors (float32) included. Muon steps the blocks' 2-D weights, torch AdamW the rest "
            "in both runs. Source: `python benchmarks/optimizers_cpu_train.py` -> "
            "`benchmarks/results/optimizers_cpu_train.json`.",
            "",
            *optimizers_cpu_train_table(data["summary"]),
            "",
        ]
    )


# -------------------------------------------------------------------------------- checkpoints
def section_offload(data: dict, path: Path) -> str:
    """offload.py: Llama-2-7B shapes on a GPU capped at 24 GB, optimizer states in host memory."""
    date, machine = provenance(data, path)
    a = data["meta"]["args"]
    return "\n".join([
        "## Optimizer states in host memory (7B shapes)" + ", repeated" * ("_repeat" in path.stem),
        f"{machine}, {date}, GPU capped at {a['cap_gb']:.0f} GB, batch {a['batch']}, seq 2048, "
        f"{a['rounds']} rounds x {a['steps']} steps: median [min-max]. coatstate: HostOffloadAdamW "
        "(FP8 moments + 24-bit master on the host, its CPU step; -4bit: 4-bit moments; -plain: FP8 "
        "without dynamic range expansion); torchao: CPUOffloadOptimizer (fp32 "
        "master and moments, torch's fused CPU AdamW). Host states: the optimizer's host bytes; host "
        "buffers: pinned weights and gradients. " + source(data, path),
        "",
        offload_table(data["setups"]),
        "",
    ])  # fmt: skip


def offload_table(results: dict) -> str:
    """offload.py's setups: GPU peak, host bytes, step times median [min-max] over rounds."""
    head = ("setup", "peak GPU GB", "host states GB", "host buffers GB", "tokens/s", "backward s",
            "host step s", "opt.step() s", "status")  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, r in results.items():
        s, hb = r.get("rounds", {}), r.get("host_bytes", {})
        status = r.get("note") or r.get("status", "?")
        status += " (warm-up step only)" if r.get("rounds_from_warmup") else ""
        cell = lambda k, spec=".2f", s=s: fmt_spread(s[k], spec) if k in s else "-"  # noqa: E731
        row = (name, f"{r['peak_gpu_gb']:.2f}" if "peak_gpu_gb" in r else "-",
               f"{hb['states'] / 1e9:.2f}" if hb else "-", f"{hb['buffers'] / 1e9:.2f}" if hb else "-",
               cell("tokens_per_s", ".0f"), cell("backward_s"), cell("host_step_s"), cell("step_s"),
               status)  # fmt: skip
        lines.append(" | ".join(row))
    return "\n".join(lines)


def section_checkpoint_io(data: dict, path: Path) -> str:
    """checkpoint_text and the checkpoint sizes' figure."""
    date, machine = provenance(data, path)
    fig, ax, png = _figure("checkpoint_size", "Optimizer checkpoint size per parameter", date, machine)
    files = data["files"]
    ax.barh(list(files), [f["bytes_per_param"] for f in files.values()], color="tab:purple")
    ax.invert_yaxis()
    ax.set_xlabel(f"bytes per parameter ({data['params'] / 1e6:.0f}M-param synthetic state)")
    return checkpoint_text(data, path) + "\n" + _save(fig, png) + "\n"


def checkpoint_text(data: dict, path: Path) -> str:
    """Sizes and MB/s of each file, what zstd buys, and (if run) the stdlib model's own states
    (checkpoint_io.py prints it too)."""
    date, machine = provenance(data, path)
    files, real = data["files"], data.get("stdlib_model")
    zstd = (f"zstd on the whole compressed file: {data['zstd_file_gain']:.3f}x; on random FP8 codes "
            f"{data['zstd_random_fp8_gain']['level3']:.3f}x (level 3).")  # fmt: skip
    out = [
        "## Checkpoints",
        f"{machine}, {date}. Synthetic {data['params'] / 1e6:.0f}M-parameter GPT-shaped AdamW state "
        "(moments shaped by a few steps of structured gradients). " + source(data, path),
        "",
        md_table(
            ["file", "MB", "bytes/param", "vs torch.save(AdamW)", "save MB/s", "load MB/s"],
            [[n, f"{r['bytes'] / 1e6:.1f}", f"{r['bytes_per_param']:.3f}",
              f"{r['ratio_vs_torch_adamw']:.3f}x", f"{r['save_MBps']:.0f}", f"{r['load_MBps']:.0f}"]
             for n, r in files.items()],
        ),  # fmt: skip
        "",
    ]
    if real is None:
        return "\n".join(out + [zstd, ""])
    out += [
        f"{zstd} A byte-level GPT trained on the standard library's source ({real['params'] / 1e6:.2f}M "
        f"params, {real['steps']} steps), each optimizer's own state after training:",
        "",
        md_table(["file", "bytes", "vs torch.save(AdamW)"],
                  [[n, r["bytes"], f"{r['ratio_vs_torch_adamw']:.3f}x"] for n, r in real["files"].items()]),
        "",
        f"zstd gain on that compressed file: {real['zstd_file_gain']:.3f}x; on its FP8 codes (level 3): "
        + ", ".join(f"{m} {g['level3']:.3f}x" for m, g in real["zstd_codes_gain"].items()) + ".",
        "",
    ]  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------------------------ accuracy
def section_parity_gpu(data: dict, path: Path) -> str:
    """parity_text and the loss curves' figure."""
    png = IMG / f"{path.stem}.png"
    plot_parity(data, png)
    return parity_text(data, path) + f"\n\n![{png.stem}](img/{png.name})\n"


def parity_text(data: dict, path: Path) -> str:
    """Seed table (mean ± std, vs AdamW's mean, paired 95% interval), the pooled noise, and what
    each FP8 format loses of AdamW's final moments (parity_gpu.py prints it too)."""
    meta, cfg = data["meta"], data["config"]
    positions = {"rope": "rotary"}.get(cfg.get("positions"), "learned")
    sampling, final = cfg.get("sampling", "one stream"), cfg.get("final_val", "the first held-out tokens")
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
            f"{fmt_num(r['std'], '.4f', '')} | {fmt_pct(r['vs_adamw_mean_pct'])} "
            f"{fmt_ci(r['welch_ci_pct'])} | "
            f"{fmt_pct(r['paired_mean_pct'])} {fmt_ci(r['paired_ci_pct'])} | "
            f"{fmt_num(r['tokens_per_s'], ',.0f', '')} | {r['peak_gib']:.1f} | {r['opt_state_mb']:.0f} | "
            f"{fmt_num(r['grad_norm_late_max'])} |"
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
                md_table(["seed", *heads], [[s, *(f"{x:.2e}" for x in xs)] for s, xs in recon])]  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------------------------ one GPU
GB = 1e9
ONE_GPU_LABELS = {
    "bf16": "bf16 + torch AdamW fused, fp32 master",
    "coatstate": "coatstate: FP8Linear + CompiledActivations + CompressedAdamW(master_bits=24)",
    "release": "coatstate + gradient release",
    "4bit": "coatstate + gradient release + 4-bit moments",
}
ONE_GPU_HEADER = (
    "setup|moments GB|master GB|activations GB (batch 1)|peak GB, batch 1 (planner, error)|tokens/s, batch "
    "1: median [min-max]|largest batch (planner's)|peak GB there (planner, error)|tokens/s there"
).split("|")
ONE_GPU_ABOUT = (
    "Llama-2 shapes (coatstate.models.Llama, random init; 7B: 32 x 4096, 32 heads, SwiGLU 11008; 13B: "
    "40 x 5120, 40 heads, 13824; vocab 32000, seq 2048) trained on ONE GPU, capped at 80 GB (1e9 "
    "bytes) with torch.cuda.set_per_process_memory_fraction on a larger card, beside COAT's Table 7 "
    "(one 80 GB GPU, Llama-2-7B: BF16 out of memory, COAT 79.3 GB and 5,906 tokens/s; 13B needs 2 "
    "GPUs). Setups, each in its own process: bf16 weights + torch AdamW(fused=True) on fp32 masters "
    "(COAT's BF16 baseline; where it runs out of memory is named); coatstate's recipe (FP8Linear, "
    "blocks compiled with CompiledActivations, CompressedAdamW master_bits=24 on bf16 weights); the "
    "same with gradient release; and with release and 4-bit moments. Activations: what a forward "
    "allocates and holds for backward; peak: torch.cuda.max_memory_allocated over the timed steps; "
    "tokens/s: median [min-max] of the timed steps; the largest batch is the largest a bounded "
    "search (from the planner's prediction, one batch at a time, within a time budget) ran; each "
    "peak has coatstate.planner's prediction beside it."
)


def _gb(b) -> str:
    return "-" if b is None else f"{b / GB:.2f}"


def _peak(r: dict) -> str:
    plan = r.get("predicted", {}).get("peak")
    if "peak_bytes" not in r:
        return f"- ({_gb(plan)})"
    if "peak_error" not in r:  # the run's plan left this setup out (its notes say why)
        return f"{_gb(r['peak_bytes'])} (-)"
    return f"{_gb(r['peak_bytes'])} ({_gb(plan)}, {100 * r['peak_error']:+.1f}%)"


def _planned_batch(res: dict) -> str:
    b = res.get("predicted_max_batch")
    return "-" if b is None else str(b)


def _speed(r: dict) -> str:
    t = r["tokens_per_s"]
    return f"{t['median']:,.0f} [{t['min']:,.0f}-{t['max']:,.0f}]"


def _row(name: str, res: dict) -> list[str]:
    label = ONE_GPU_LABELS.get(name, name)
    b1, big = res.get("batch1"), res.get("largest")
    if b1 is None:
        oom = res.get("oom")
        why = f"out of memory at batch 1 in {oom['phase']}" if oom else res.get("status", "no result")
        plan = (res.get("predicted_batch1") or {}).get("peak")
        planned = f"- ({_planned_batch(res)})"
        return [label, why, "", "", f"- ({_gb(plan)})", "", planned, "", ""]
    cut = " (time)" if res.get("search", {}).get("cut_short_by_budget") else ""
    largest = f"{big['batch']}{cut} ({_planned_batch(res)})"
    return [label, _gb(b1["moment_bytes"]), _gb(b1["master_bytes"]), _gb(b1["activation_bytes"]),
            _peak(b1), _speed(b1), largest, _peak(big), _speed(big)]  # fmt: skip


def section_one_gpu(data: dict, path: Path, replan_now: bool = True) -> str:
    """benchmarks/one_gpu.py: a table per model, its setups as rows; with `replan_now`, the
    planner's peaks now beside the measured ones (one_gpu_replan.py: a trace on the CPU)."""
    import one_gpu_replan

    from coatstate.planner.report import first_paragraph

    date, machine = provenance(data, path)
    meta = data["meta"]
    cap = meta.get("memory_cap") or {}
    capped = "not capped"
    if cap.get("cap_bytes"):
        capped = f"capped at {cap['cap_bytes'] / GB:.0f} GB of {cap['total_bytes'] / GB:.1f} GB"
    parts = []
    for name, entry in data["models"].items():
        c = entry["config"]
        parts += [
            f"## One GPU: Llama {name} ({c['params'] / 1e9:.2f}B params, seq {c['seq']})",
            f"{machine}, {date}, torch {meta.get('torch', '?')}, memory {capped}. {ONE_GPU_ABOUT} Source: "
            f"`benchmarks/one_gpu.py` -> `benchmarks/results/{path.name}`.",
            "",
            md_table(ONE_GPU_HEADER, [_row(n, r) for n, r in entry["setups"].items()]),
            "",
        ]
        replanned = one_gpu_replan.replan(data, name) if replan_now else []
        if replanned:  # the planner as it is now, against every measured peak
            worst = max(abs(r["error"]) for r in replanned)
            parts += [
                f"The planner now (coatstate.planner, on the CPU: `benchmarks/one_gpu_replan.py`; "
                "`tests/planner/test_against_gpu_peaks.py` holds each within 3%) against every measured "
                f"peak: the largest error is {100 * worst:.1f}%. The run's own predictions, where its "
                "plan made them, are beside them.",
                "",
                md_table(one_gpu_replan.HEADER, one_gpu_replan.table_rows(replanned)),
                "",
            ]
        setups = entry["setups"].items()
        notes = [f"{ONE_GPU_LABELS.get(n, n)}: {r['status']}" for n, r in setups if r["status"] != "ok"]
        left_out = sorted({first_paragraph(n) for _, r in setups for n in r.get("plan_notes", [])})
        notes += [f"The run's own plan: {n}" for n in left_out]
        if entry.get("paper"):
            notes.append(f"Paper: {entry['paper']}.")
        parts += [*notes, ""] if notes else []
    return "\n".join(parts)


SECTIONS = {  # result file stem -> its section of docs/benchmarks.md, in the page's order
    "whole_state_step": section_whole_state_step,
    "optimizer_step": section_optimizer_step,
    "optimizer_cpu": section_optimizer_cpu,
    "optimizers_cpu_train": section_optimizers_cpu_train,
    "offload": section_offload,
    "offload_repeat": section_offload,  # the same machine minutes later: the run-to-run spread
    "parity_gpu": section_parity_gpu,
    "parity_gpu_learned": section_parity_gpu,  # docs/accuracy.md: why rotary positions
    "activation_memory": section_activation_memory,
    "activation_memory_llama": section_activation_memory,
    "fp8_linear_train_rounds": section_fp8_linear_train,
    "checkpoint_io": section_checkpoint_io,
    "one_gpu_7b": section_one_gpu,
    "one_gpu_13b": section_one_gpu,
}


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
    spread = lambda r: fmt_num(r["spread_pct"], ".2f", "") + ("%" if r["spread_pct"] is not None else "")
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
    out = [head, "", md_table(cols, table)]
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
    labels = {"coatstate": "the FP8 recipe", "release": "+ gradient release"}
    labels["4bit"] = "+ release, 4-bit moments"
    s7 = seven["models"]["7b"]["setups"]["coatstate"]["batch1"]
    ok13 = [(k, v["batch1"]) for k, v in thirteen["models"]["13b"]["setups"].items() if v.get("batch1")]
    k13, s13 = min(ok13, key=lambda kv: kv[1]["peak_bytes"])
    fig = lambda r: f"{r['peak_bytes'] / 1e9:.1f} GB, {r['tokens_per_s']['median']:,.0f} tokens/s"  # noqa: E731
    return (f"one {seven['meta']['machine']} capped at 80 GB, seq 2048, batch 1: Llama-2-7B {fig(s7)} "
            f"({labels['coatstate']}), Llama-2-13B {fig(s13)} ({labels[k13]}); bf16 + torch AdamW runs "
            "out of memory on both. COAT's Table 7: 7B at 79.3 GB and 5,906 tokens/s, 13B needs 2 GPUs.")


def cpu_step_line(data: dict) -> str:
    """The README's answer to "how fast is the CPU step?": optimizer_cpu.py at its most threads."""
    threads = max(data["by_threads"], key=int)
    rows, first = data["by_threads"][threads]["rows"], data["by_threads"][threads]["first_step_s"]
    x = lambda name: f"{rows['coatstate ' + name]['vs_reference']:.1f}x"  # noqa: E731
    return (f"On {data['meta']['machine']} ({threads} threads, {data['meta']['date'][:10]}), "
            f"CompressedAdamW's CPU step takes {x('defaults (FP8, expansion)')} torch's fused AdamW's "
            f"time with the defaults, {x('plain E4M3')} with plain E4M3 and {x('4-bit (e2m1 / ue3m1_sqrt)')} "
            f"with 4-bit moments; the first step of a process builds the C++ step in {first['cold']:.0f} s "
            f"once, then loads it in {first['warm']:.1f} s "
            "([details](docs/benchmarks.md#optimizer-step-cpu)).")


def tables() -> dict[str, str]:
    """{marker name: markdown} of every generated table of the README and docs pages."""
    load = lambda name: json.loads((RESULTS / f"{name}.json").read_text())
    parity = load("parity_gpu")
    return {
        "accuracy": accuracy_table(parity),
        "accuracy-summary": accuracy_table(parity, short=True),
        "headline": headline_table(*map(load, ("whole_state_step", "activation_memory", "checkpoint_io"))),
        "one-gpu": one_gpu_line(load("one_gpu_7b"), load("one_gpu_13b")),
        "cpu-step": cpu_step_line(load("optimizer_cpu")),
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
        parts.append(section(json.loads(path.read_text()), path))
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
