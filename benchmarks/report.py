"""python benchmarks/report.py

Collects the JSON the benchmark scripts write (benchmarks/results/*.json) into docs/benchmarks.md,
with PNG figures in docs/img/: step time against the bandwidth floor, activation memory bars,
checkpoint sizes and training loss curves (AdamW parity, FP8 linear parity); tables for FSDP2
training, FP8 linear training, the memory planner check and the host cost of activation
compression (activation_host.json and activation_host_cuda.json in one section). Every table and
figure names the machine and the date the JSON records; where a file does not record them, the
date its JSON was last committed is used and the machine is given as what the file says (or "not
recorded"). A missing result is skipped with a line saying so; a result this script does not know
is listed with its top-level numbers.
Needs matplotlib (pip install -e '.[plots]').

The GPU-run sections live in report_gpu.py and the helpers both use in report_common.py (so neither
imports this file back). machine_meta() is the provenance block the CPU benchmarks (training_parity,
optimizer_cpu, checkpoint_io) store under "meta", so this report can name the machine; they import
it from here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from readme_tables import update_readme
from report_common import (  # machine_meta: the CPU benchmarks import it from here
    DOCS,
    IMG,
    RESULTS,
    ROOT,
    _f,
    _figure,
    _md_table,
    _running_mean,
    _save,
    fmt_spread,
    machine_meta,  # noqa: F401
    plot_loss_curves,
    provenance,
)
from report_gpu import (
    section_activation_kernels,
    section_checkpoint_load,
    section_checkpoint_scale,
    section_fp8_linear_train,
    section_fsdp_train,
    section_kernel_breakdown,
    section_master_train,
    section_optimizer_step,
    section_plan_check,
    section_table7,
)
from report_cpu import section_optimizer_cpu
from report_host import section_activation_host, section_host_primitives
from report_kernels import section_kernel_static
from report_linear import section_fp8_width
from report_one_gpu import missing_one_gpu, section_one_gpu
from report_states import (
    section_fp4_reconstruction,
    section_fp4_shadow,
    section_optimizers_cpu_train,
    section_parity_gpu,
    section_parity_step_profile,
)


def _flags(args: dict) -> str:
    """The activation_memory.py flags a rounds JSON was made with (those that change what ran)."""
    out = " --arch llama" if args.get("arch") == "llama" else ""
    if args.get("compiled") and not args.get("cudagraphs"):
        out += " --compiled" + (" model" if args["compiled"] == "model" else "")
    out += " --cudagraphs" if args.get("cudagraphs") else ""
    out += f" --rounds {args['rounds']} --steps {args['steps']}" if args.get("rounds") else ""
    out += f" --inductor {args['inductor']}" if args.get("inductor") else ""
    return out + (f' --variants "{args["variants"]}"' if args.get("variants") else "")


def _section_activation_rounds(data: dict, path: Path) -> str:
    """activation_memory.py's interleaved-rounds JSON (benchmarks/rounds.py): medians with min-max
    over rounds, paired ratios, kernel time and GPU busy fraction."""
    date, machine = provenance(data, path)
    args = data.get("args", {})
    shape = ", ".join(f"{k} {args[k]}" for k in ("arch", "layers", "dim", "seq", "batch") if k in args)

    rows = [
        [
            r["variant"],
            _f(r["activation_bytes"] and r["activation_bytes"] / 1e9),
            _f(r.get("activation_vs_base"), ".3f") + ("x" if r.get("activation_vs_base") else ""),
            fmt_spread(r["wall_ms"], ".1f"),
            fmt_spread(r["wall_vs_base"], ".3f", "x"),
            fmt_spread(r["kernel_ms"], ".1f"),
            fmt_spread(r["kernel_vs_base"], ".3f", "x"),
            _f(r["busy"] and r["busy"]["median"]) + (" host-bound" if r["host_bound"] else ""),
        ]
        for r in data["rows"]
    ]
    header = "variant|activation GB|vs base|wall ms|vs base (wall)|kernel ms|vs base (GPU)|GPU busy"
    return "\n".join(
        [
            f"## Activation memory and step time, {shape} "
            f"({'' if args.get('compiled') or args.get('cudagraphs') else 'eager only, '}interleaved rounds"
            + (f", inductor {args['inductor']} for every compiled variant)" if args.get("inductor") else ")"),
            f"{machine}, {date}. {args.get('rounds')} rounds x {args.get('steps')} steps, the variants "
            "interleaved in one process, order rotated per round: median [min-max over rounds]; ratios "
            "are the median [min-max] of per-round ratios to the row's base (eager `none`, `compiled: "
            "none` or `cudagraphs: none`). Kernel ms = GPU busy time of one profiled step per round; "
            "GPU busy = kernel / wall (below 0.9: host-bound). Activation memory = peak minus what is "
            "allocated before a warm-up step. Source: "
            f"`python benchmarks/activation_memory.py{_flags(args)}` -> `benchmarks/results/{path.name}`.",
            "",
            _md_table(header.split("|"), rows),
            "",
        ]
    )


def section_activation_memory(data: dict, path: Path) -> str:
    if data.get("method") == "rounds":
        return _section_activation_rounds(data, path)
    date, machine = provenance(data, path)
    rows = data["rows"]
    base = next((r for r in rows if r["variant"] == "none"), rows[0])
    compiled_base = next((r for r in rows if r["variant"] == "compiled: none"), base)
    args = data.get("args", {})
    shape = ", ".join(f"{k} {args[k]}" for k in ("arch", "layers", "dim", "seq", "batch") if k in args)

    def ratios(r: dict) -> list[str]:
        b = compiled_base if r["variant"].startswith("compiled") else base
        return [
            f"{r['activation_bytes'] / b['activation_bytes']:.2f}x",
            f"{r['step_ms'] / b['step_ms']:.2f}x",
            f"{r['step_ms'] / base['step_ms']:.2f}x",
        ]

    whole = path.stem.endswith("whole_model_compile")
    arch = args.get("arch", "gpt")
    out = [
        f"## Activation memory, {'Llama-style' if arch == 'llama' else 'GPT-2-style'} model"
        + (", the whole model compiled as one graph" if whole else "")
        + (" (linear inputs per group)" if path.stem.endswith("linear_group") else ""),
        f"{machine}, {date}. {shape}. Activation memory = peak minus parameters, gradients and optimizer "
        "state. Ratios are to the uncompressed step of the same mode (eager, or each block "
        "torch.compile'd for the `compiled:` rows); the last column is always to eager `none`. Host "
        "fwd = host time to issue the forward: close to the eager step's GPU forward already, so "
        "every microsecond of Python in the saved-tensor hooks lengthens the step. `compiled: "
        "CompiledActivations` runs no hooks: its FP8 pack/unpack nodes are inside the compiled graphs. "
        f"Source: `python benchmarks/activation_memory.py{' --arch llama' if arch == 'llama' else ''} "
        f"--compiled{' model' if whole else ''}` -> "
        f"`benchmarks/results/{path.name}`." + (f" Note: {data['note']}." if data.get("note") else ""),
        "",
        _md_table(
            "variant|activation GB|vs same mode|step ms|vs same mode|vs eager none|host fwd ms".split("|"),
            [
                [r["variant"], f"{r['activation_bytes'] / 1e9:.2f}"]
                + ratios(r)[:1]
                + [f"{r['step_ms']:.1f}"]
                + ratios(r)[1:]
                + [f"{r.get('host_fwd_ms', float('nan')):.1f}"]
                for r in rows
            ],
        ),
        "",
    ]
    fig, ax, png = _figure(path.stem, "Activation memory per training step", date, machine)
    ax.bar(range(len(rows)), [r["activation_bytes"] / 1e9 for r in rows], color="tab:green")
    ax.set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=20, ha="right", fontsize=8)
    for i, r in enumerate(rows):
        ax.text(
            i,
            r["activation_bytes"] / 1e9,
            f"{r['activation_bytes'] / base['activation_bytes']:.2f}x\n{r['step_ms']:.0f} ms",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("GB (peak minus static)")
    ax.margins(y=0.2)
    out += [_save(fig, png), ""]
    return "\n".join(out)


def section_checkpoint_io(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    files = data["files"]
    out = [
        "## Checkpoints",
        f"{machine}, {date}. Source: `python benchmarks/checkpoint_io.py` -> "
        "`benchmarks/results/checkpoint_io.json`.",
        "",
        f"Synthetic {data['params'] / 1e6:.0f}M-parameter GPT-shaped AdamW state (moments shaped by a few "
        "steps of structured gradients):",
        "",
        _md_table(
            ["file", "MB", "bytes/param", "vs torch.save(AdamW)", "save MB/s", "load MB/s"],
            [
                [
                    name,
                    f"{r['bytes'] / 1e6:.1f}",
                    f"{r['bytes_per_param']:.3f}",
                    f"{r['ratio_vs_torch_adamw']:.3f}x",
                    f"{r['save_MBps']:.0f}",
                    f"{r['load_MBps']:.0f}",
                ]
                for name, r in files.items()
            ],
        ),
        "",
        f"zstd on the whole compressed file: {data['zstd_file_gain']:.3f}x; on random FP8 codes "
        f"{data['zstd_random_fp8_gain']['level3']:.3f}x (level 3).",
        "",
    ]
    real = data.get("stdlib_model")
    if real:
        out += [
            f"The standard-library model of the training-parity run ({real['params'] / 1e6:.2f}M params, "
            f"{real['steps']} steps), each optimizer's own state after training:",
            "",
            _md_table(
                ["file", "bytes", "vs torch.save(AdamW)"],
                [
                    [name, r["bytes"], f"{r['ratio_vs_torch_adamw']:.3f}x"]
                    for name, r in real["files"].items()
                ],
            ),
            "",
            f"zstd gain on that compressed file: {real['zstd_file_gain']:.3f}x; on its FP8 codes (level 3): "
            + ", ".join(f"{m} {g['level3']:.3f}x" for m, g in real["zstd_codes_gain"].items())
            + ".",
            "",
        ]
    fig, ax, png = _figure("checkpoint_size", "Optimizer checkpoint size per parameter", date, machine)
    names = list(files)
    ax.barh(names, [files[n]["bytes_per_param"] for n in names], color="tab:purple")
    ax.invert_yaxis()
    ax.set_xlabel(f"bytes per parameter ({data['params'] / 1e6:.0f}M-param synthetic state)")
    out += [_save(fig, png), ""]
    return "\n".join(out)


def _parity_args(data: dict) -> str:
    """The non-default arguments of a training_parity run (seed, a subset of the variants)."""
    seed, subset = data["config"].get("seed", 0), data.get("variants_arg")
    return (f" --seed {seed}" if seed else "") + (f" --variants {subset}" if subset else "")


def section_training_parity(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    cfg = data["config"]
    out = [
        "## Training parity" + ("" if path.stem == "training_parity" else f" ({path.stem})"),
        f"{machine}, {date}, torch {data['meta'].get('torch', '?')}. A byte-level GPT "
        f"({data['params'] / 1e6:.2f}M params, {cfg['layers']} layers, width {cfg['dim']}) on the Python "
        f"standard library's source, {cfg['steps']} steps, batch {cfg['batch']} x {cfg['seq']} bytes, "
        f"lr {cfg['lr']}, the same seed and batches for every variant. Final loss = mean of the last "
        f"{data['tail']} steps; pass = within "
        f"{100 * data['bound']:.0f}% of the reference (torch.optim.AdamW; for CompiledActivations the same "
        "optimizer with its blocks compiled, uncompressed). Source: "
        f"`python benchmarks/training_parity.py{_parity_args(data)}` -> "
        f"`benchmarks/results/{path.name}`." + (f" Note: {data['note']}." if data.get("note") else ""),
        "",
        _md_table(
            [
                "variant",
                "final loss",
                "vs AdamW",
                "vs reference",
                "pass",
                "state B/param",
                "act. held / saved",
                "step ms",
            ],
            [
                [
                    v["name"],
                    f"{v['final_loss']:.4f}",
                    f"{100 * v['rel_diff_vs_adamw']:+.2f}%",
                    f"{100 * v.get('rel_diff_vs_reference', v['rel_diff_vs_adamw']):+.2f}%",
                    "yes"
                    if abs(v.get("rel_diff_vs_reference", v["rel_diff_vs_adamw"])) <= data["bound"]
                    else "NO",
                    f"{v['state_bytes'] / data['params']:.3f}",
                    f"{v['activation_bytes_held'] / max(1, v['activation_bytes_saved']):.2f}",
                    f"{v['step_ms']:.0f}",
                ]
                for v in data["variants"]
            ],
        ),
        "",
    ]
    fig, ax, png = _figure(path.stem, "Byte-level GPT on the stdlib source: training loss", date, machine)
    runs = {v["name"]: v["losses"] for v in data["variants"]}
    plot_loss_curves(
        ax, runs, {v["name"]: f"{v['name']} (final {v['final_loss']:.4f})" for v in data["variants"]}
    )
    ax.set_xlabel("step")
    out += [_save(fig, png), ""]
    return "\n".join(out)


def section_unknown(name: str, data: dict, path: Path) -> str:
    """A result without its own section: its top-level numbers."""
    date, machine = provenance(data, path)
    scalars = [[k, v] for k, v in data.items() if isinstance(v, (int, float, str, bool))]
    out = [
        f"## {name}",
        f"{machine}, {date}. `benchmarks/results/{path.name}` (no dedicated section; top-level values):",
        "",
        _md_table(["key", "value"], scalars) if scalars else "(none)",
        "",
    ]
    return "\n".join(out)


def section_fp8_linear_parity(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    cfg, runs, tol = data["config"], data["runs"], data["tolerance"]
    rel = {n: r.get("relative_difference", 0.0) for n, r in runs.items()}
    out = [
        "## FP8 linear layers: training parity",
        f"{machine}, {date}, torch {data.get('torch', '?')}. The byte-level GPT ({data['params'] / 1e6:.2f}M "
        f"params, {cfg['layers']} layers, width {cfg['dim']}) on the Python standard library's source, "
        f"{cfg['steps']} steps, batch {cfg['batch']} x {cfg['seq']} bytes, the same initial weights and "
        "batches, bf16 autocast and torch.optim.AdamW for every run. The fp8 runs convert every linear layer "
        "with coatstate.nn.convert_to_fp8 (E4M3 inputs and weights, output gradients in the named format; "
        "the tied head stays bf16 unless fp8-head), emulated in fp32 on CPU. Final loss = mean of the last "
        f"{cfg['tail']} steps; pass = within {100 * tol:.0f}% of bf16 (the gate is `{data['compared']}`, in "
        f"bold: {'PASS' if data['passed'] else 'FAIL'}). Source: `{data.get('command')}` -> "
        "`benchmarks/results/fp8_linear_parity.json`.",
        "",
        _md_table(
            ["run", "final loss", "vs bf16", f"within {100 * tol:.0f}%", "seconds"],
            [
                [
                    f"**{n}**" if n == data["compared"] else n,
                    f"{r['final_loss']:.4f}",
                    f"{100 * rel[n]:+.2f}%",
                ]
                + ["yes" if abs(rel[n]) <= tol else "no", f"{r['seconds']:.0f}"]
                for n, r in runs.items()
            ],
        ),
        "",
    ]
    fig, (ax, dx), png = _figure(
        "fp8_linear_parity", "FP8 linear layers vs bf16: training loss", date, machine, 2
    )
    losses = {n: r["losses"] for n, r in runs.items()}
    plot_loss_curves(ax, losses, {n: f"{n} (final {runs[n]['final_loss']:.4f})" for n in runs})
    ref = _running_mean(losses.get("bf16") or next(iter(losses.values())))
    for xs in losses.values():  # running means against bf16's: where the runs drift apart
        dx.plot([100 * (a / b - 1) for a, b in zip(_running_mean(xs), ref, strict=True)], linewidth=1.2)
    dx.axhspan(-100 * tol, 100 * tol, color="0.9", zorder=0, label=f"within {100 * tol:.0f}%")
    dx.set_ylabel("running mean vs bf16 (%)")
    dx.set_xlabel("step")
    dx.legend(fontsize=8, loc="upper left")
    out += [_save(fig, png), ""]
    return "\n".join(out)


def section_whole_state_step(data: dict, path: Path) -> str:
    m = data["meta"]
    # the other runs too: expand_off, the launch-config sweep, the kernel before that sweep's default
    variant = "" if path.stem == "whole_state_step" else f" (`{path.name}`)"
    out = [
        f"## The whole training state per parameter (GPU){variant}",
        f"{m.get('machine', m['device'])}, {m['date']}, "
        f"copy bandwidth {m['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
        f"median of {m['rounds']} interleaved rounds of {m['steps']} back-to-back steps (spread min-max). "
        f"Source: `python benchmarks/whole_state_step.py` -> `benchmarks/results/{path.name}`.",
    ]
    if any(" [" in r["name"] for r in data["rows"]):
        out += [
            "",
            "`[GxWrR]`: the fused kernel's launch, G groups of 128 a program, W warps, registers capped at R "
            "(none: ptxas decides). The default was 8x4 until 2026-12-03, 2x1r64 since (the sweep's fastest "
            "or tied launch for every moment format).",
        ]
    out += [
        "",
        "| optimizer | weights | correction | grads | moments | total B | with release | floor ms | step ms "
        "| spread | first s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "step_ms" not in r:
            out.append(f"| {r['name']} | failed: {r.get('error', '')} |")
            continue
        floor = "" if r["floor_ms"] != r["floor_ms"] else f"{r['floor_ms']:.2f}"  # (NaN: a peer's layout)
        out.append(
            f"| {r['name']} | {r['weights_B']:.2f} | {r['correction_B']:.2f} | {r['grads_B']:.2f} | "
            f"{r['moments_B']:.2f} | {r['total_B']:.2f} | {r['total_with_release_B']:.2f} | {floor} | "
            f"{r['step_ms']:.2f} | {r['spread_ms'][0]:.2f}-{r['spread_ms'][1]:.2f} | "
            f"{r['first_step_s']:.2f} |"
        )
    return "\n".join(out + [""])


TREE_COMPARISONS = {  # result file -> (title, what "old" and "new" are)
    "compare_trees": ("the subpackage split", "the tree before and after it"),
    "compare_nan_policy": (
        "the NaN/Inf policy",
        "commit 96aca67 (a NaN zeroed its group) and the tree that keeps non-finite values per element",
    ),
}


def section_compare_trees(data: dict, path: Path) -> str:
    title, what = TREE_COMPARISONS[path.stem]
    out = [
        f"## Step time before and after {title} (GPU)",
        f"`benchmarks/optimizer_step.py {data['args']}` of {what}, in alternating processes, "
        f"{data['rounds']} rounds. Source: `python benchmarks/compare_trees.py` -> "
        f"`benchmarks/results/{path.name}`.",
        "",
        "| variant | old ms | new ms | new / old |",
        "|---|---|---|---|",
    ]
    for r in data["rows"]:
        out.append(f"| {r['name']} | {r['old_median']:.3f} | {r['new_median']:.3f} | {r['ratio']:.3f} |")
    return "\n".join(out + [""])


def section_activation_policy_cosine(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    groups: dict = {}
    for r in data["rows"]:
        groups.setdefault((r["arch"], r["policy"]), []).append(r)
    rows = [
        [arch, policy, f"{min(r['compiled_cosine'] for r in rs):.6f}", f"{rs[0]['compiled_ratio']:.2f}x",
         f"{min(r['eager_cosine'] for r in rs):.6f}", f"{rs[0]['eager_ratio']:.2f}x", rs[0]["compiled_worst"]]
        for (arch, policy), rs in groups.items()
    ]  # fmt: skip
    m, seeds = data["model"], len(next(iter(groups.values())))
    return "\n".join(
        [
            "## Gradient cosine of the activation policies (CPU)",
            f"{machine}, {date}, torch {data.get('torch', '?')}. benchmarks/models.py blocks, {m['layers']} "
            f"layers x {m['dim']}, seq {m['seq']}, batch {m['batch']}, bf16 autocast; the worst cosine over "
            f"all parameters between compressed and uncompressed gradients, lowest of {seeds} seeds "
            "(compiled: CompiledActivations against the same compiled blocks; eager: compress_activations). "
            f"Source: `python benchmarks/activation_policy_cosine.py` -> `benchmarks/results/{path.name}`.",
            "",
            _md_table(
                [
                    "model",
                    "policy",
                    "compiled cosine",
                    "compiled smaller",
                    "eager cosine",
                    "eager smaller",
                    "worst parameter (compiled)",
                ],
                rows,
            ),  # fmt: skip
            "",
        ]
    )


SECTIONS = {
    "optimizer_step": section_optimizer_step,
    "optimizer_cpu": section_optimizer_cpu,
    "optimizers_cpu_train": section_optimizers_cpu_train,
    "activation_memory": section_activation_memory,
    "activation_memory_llama": section_activation_memory,
    "activation_memory_linear_group": section_activation_memory,
    "activation_memory_llama_linear_group": section_activation_memory,
    "activation_memory_whole_model_compile": section_activation_memory,
    "activation_memory_eager": section_activation_memory,
    "activation_memory_tuned": section_activation_memory,
    "activation_memory_2026-12-01": section_activation_memory,
    "activation_memory_llama_2026-12-01": section_activation_memory,
    "activation_kernels": section_activation_kernels,
    "kernel_breakdown_gpt": section_kernel_breakdown,
    "kernel_breakdown_fp8_ca": section_kernel_breakdown,
    "kernel_breakdown_fp8_ca_2026-12-01": section_kernel_breakdown,
    "kernel_breakdown_fp8_graphs": section_kernel_breakdown,
    "kernel_breakdown_fp8_graphs_all": section_kernel_breakdown,
    "activation_policy_cosine": section_activation_policy_cosine,
    "checkpoint_io": section_checkpoint_io,
    "training_parity": section_training_parity,
    **{f"training_parity_seed{n}": section_training_parity for n in range(1, 8)},
    "training_parity_linear_group": section_training_parity,
    "training_parity_linear_group_seed1": section_training_parity,
    "training_parity_linear_group_seed2": section_training_parity,
    "fsdp_train": section_fsdp_train,
    "fp8_linear_train": section_fp8_linear_train,
    "fp8_linear_train_graphs": section_fp8_linear_train,
    "fp8_linear_train_graphs_all": section_fp8_linear_train,
    "fp8_linear_train_rounds": section_fp8_linear_train,
    "fp8_linear_train_rounds_2026-12-03": section_fp8_linear_train,
    "fp8_width": section_fp8_width,
    "plan_check": section_plan_check,
    "activation_host": section_activation_host,
    "host_primitives": section_host_primitives,
    "fp8_linear_parity": section_fp8_linear_parity,
    "table7": section_table7,
    "table7_x2_4layers": section_table7,
    "whole_state_step": section_whole_state_step,
    "whole_state_step_expand_off": section_whole_state_step,
    "whole_state_step_5rounds": section_whole_state_step,
    "whole_state_step_launch_sweep": section_whole_state_step,
    "whole_state_step_2026-12-02": section_whole_state_step,
    "parity_gpu": section_parity_gpu,
    "parity_gpu_learned": section_parity_gpu,
    "parity_gpu_val1M": section_parity_gpu,
    "parity_gpu_session1": section_parity_gpu,
    "parity_gpu_contiguous": section_parity_gpu,
    "parity_gpu_minlr0": section_parity_gpu,
    "parity_gpu_lr3e-4": section_parity_gpu,
    "parity_step_profile": section_parity_step_profile,
    "kernel_static": section_kernel_static,
    "kernel_static_triton36": section_kernel_static,
    "parity_step_profile_table": section_parity_step_profile,
    "fp4_reconstruction": section_fp4_reconstruction,
    "fp4_shadow": section_fp4_shadow,
    "compare_trees": section_compare_trees,
    "compare_nan_policy": section_compare_trees,
    "master_train": section_master_train,
    "checkpoint_scale_cuda": section_checkpoint_scale,
    "checkpoint_scale_cpu": section_checkpoint_scale,
    "checkpoint_scale_cpu16": section_checkpoint_scale,
    "checkpoint_load": section_checkpoint_load,
    **{f"one_gpu_{m}": section_one_gpu for m in ("7b", "13b")},
}
COVERED = {"activation_host_cuda", "host_primitives_cuda"}  # shown in another file's section
MISSING = {f"one_gpu_{m}": missing_one_gpu for m in ("7b", "13b")}  # before their (GPU) run


def main() -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("benchmarks/report.py needs matplotlib: pip install -e '.[plots]'", file=sys.stderr)
        return 1
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from the JSON in `benchmarks/results/`; do not edit "
        "by hand. Each section names the machine and date its numbers come from.",
        "",
    ]
    for name, section in SECTIONS.items():
        path = RESULTS / f"{name}.json"
        if not path.exists() and name in MISSING:
            parts.append(MISSING[name](name))
            continue
        if not path.exists():
            parts += [
                f"## {name}",
                f"No `benchmarks/results/{name}.json` yet: run `python benchmarks/{name}.py`.",
                "",
            ]
            print(f"skipped {name}: no {path.relative_to(ROOT)}")
            continue
        try:
            parts.append(section(json.loads(path.read_text()), path))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            parts += [
                f"## {name}",
                f"`{path.name}` is not in the layout this report knows ({type(e).__name__}: {e}).",
                "",
            ]
            print(f"could not read {path.name}: {type(e).__name__}: {e}", file=sys.stderr)
    for path in sorted(RESULTS.glob("*.json")):
        if path.stem not in SECTIONS and path.stem not in COVERED:
            parts.append(section_unknown(path.stem, json.loads(path.read_text()), path))
    DOCS.mkdir(exist_ok=True)
    (DOCS / "benchmarks.md").write_text("\n".join(parts).rstrip() + "\n")
    print(f"wrote {(DOCS / 'benchmarks.md').relative_to(ROOT)} and figures in {IMG.relative_to(ROOT)}/")
    print(f"README tables rewritten: {', '.join(update_readme()) or 'none (no markers)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
