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

machine_meta() is the provenance block the CPU benchmarks (training_parity, optimizer_cpu,
checkpoint_io) store under "meta", so this report can name the machine.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
IMG = DOCS / "img"


def machine_meta(device: str = "cpu") -> dict:
    """Date (UTC), machine, software versions and the load when a benchmark started."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    else:
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            platform.processor() or platform.machine(),
        )
        machine = f"{model}, {os.cpu_count()} CPU cores"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def provenance(data: dict, path: Path) -> tuple[str, str]:
    """(date, machine) of a result file, from its meta block or, failing that, git and its args."""
    meta = {
        **{k: data[k] for k in ("date", "machine") if isinstance(data.get(k), str)},
        **(data.get("meta") or {}),
    }
    date = meta.get("date")
    if not date:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT, capture_output=True, text=True
        )
        date = f"{out.stdout.strip()} (commit date)" if out.stdout.strip() else "date not recorded"
    named = [data.get("device_name"), data.get("device")]  # a top-level name, not a bare "cuda"
    machine = meta.get("machine") or meta.get("device") or next((d for d in named if _device_name(d)), None)
    if not machine:
        device = (data.get("args") or {}).get("device")
        torch_version = data.get("torch") or meta.get("torch")
        known = ", ".join(
            x for x in (device and f"device {device}", torch_version and f"torch {torch_version}") if x
        )
        machine = f"machine not recorded ({known})" if known else "machine not recorded"
    if meta.get("load_average_1min") is not None:  # CPU timings: how busy the machine was
        machine += (
            f" (load average {meta['load_average_1min']} at start, {meta.get('threads', '?')} torch threads)"
        )
    return date, machine


def _device_name(device) -> bool:
    return isinstance(device, str) and device.split(":")[0] not in ("cpu", "cuda", "mps", "xpu", "")


def _f(value, spec: str = ".2f", missing: str = "-") -> str:
    """A number formatted by spec, or `missing` where an older JSON lacks the field."""
    return missing if value is None else format(value, spec)


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


def _running_mean(xs: list[float], window: int = 20) -> list[float]:
    return [
        sum(xs[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))
    ]


def plot_loss_curves(ax, runs: dict[str, list[float]], labels: dict[str, str]) -> None:
    """Loss per step of each run (light) and its 20-step running mean, labelled."""
    for name, losses in runs.items():
        line = ax.plot(losses, alpha=0.25, linewidth=0.8)[0]
        ax.plot(_running_mean(losses), color=line.get_color(), linewidth=1.6, label=labels[name])
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.legend(fontsize=8)
    first = next(iter(runs.values()))[0]
    ax.set_ylim(top=min(ax.get_ylim()[1], first * 1.05))


def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def section_optimizer_step(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    meta = data.get("meta", {})
    rows = data["rows"]
    bw = meta.get("copy_bandwidth_Bps")

    def step(r: dict) -> float:  # the headline: back to back where recorded, else the synced median
        return r.get("pipelined_ms") or r["step_ms"]

    def mb(r: dict) -> float | None:
        return None if r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / 1e6

    header = "optimizer|params dtype|state B/param|step ms (back to back)|synced ms|floor ms|x floor"
    table = [
        [r["name"], r.get("dtype", "?"), f"{r['state_bytes_per_param']:.3f}", _f(r.get("pipelined_ms"))]
        + [f"{r['step_ms']:.2f}", f"{r['floor_ms']:.2f}", f"{step(r) / r['floor_ms']:.2f}"]
        + [_f(r.get("first_step_s")), _f(mb(r), ".0f")]
        for r in rows
    ]
    old = sum(r.get("pipelined_ms") is None for r in rows)
    out = [
        "## Optimizer step (GPU)",
        f"{machine}, {date}, torch {meta.get('torch', '?')}"
        + (f", copy bandwidth measured in the same run {bw / 1e12:.2f} TB/s" if bw else "")
        + ". Source: `python benchmarks/optimizer_step.py` -> `benchmarks/results/optimizer_step.json`. "
        "Floor = bytes the step must move / copy bandwidth; x floor = step ms / floor ms. Step ms is the "
        "GPU time per step with steps run back to back, as in a training loop where the host queues the "
        "next step while the GPU works; synced ms is the median of single steps each followed by a "
        "synchronisation, so it also counts the host's launch time wherever the GPU would idle. First "
        "step s includes Triton compilation; peak extra MB is the memory a step allocates.",
        "",
        _md_table(header.split("|") + ["first step s", "peak extra MB"], table),
        "",
    ]
    if old:
        out += [f"{old} row(s) from an older run record no back-to-back time: x floor uses synced ms.", ""]
    for dtype in dict.fromkeys(r.get("dtype", "?") for r in rows):
        sub = [r for r in rows if r.get("dtype", "?") == dtype]
        fig, ax, png = _figure(
            f"optimizer_step_{dtype}", f"Optimizer step vs bandwidth floor ({dtype} params)", date, machine
        )
        y = [2.5 * i for i in range(len(sub))]
        ax.barh([v - 0.45 for v in y], [step(r) for r in sub], height=0.9, label="step (back to back)")
        ax.barh([v + 0.45 for v in y], [r["floor_ms"] for r in sub], height=0.9, color="0.7", label="floor")
        for v, r in zip(y, sub, strict=True):
            ax.text(
                step(r),
                v - 0.45,
                f" {step(r):.1f} ms, {step(r) / r['floor_ms']:.2f}x floor",
                va="center",
                fontsize=7,
            )
        ax.set_yticks(y, [f"{r['name']} ({r['state_bytes_per_param']:.2f} B/param)" for r in sub], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")  # the peers are 10-50x off the floor; on a log axis the fast rows stay readable
        ax.margins(x=0.3)
        ax.set_xlabel("ms per step, log scale (floor = bytes moved / copy bandwidth)")
        ax.legend(fontsize=8, loc="lower right")
        out += [_save(fig, png), ""]
    return "\n".join(out)


def section_optimizer_cpu(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    rows = data["rows"]
    return "\n".join(
        [
            "## Optimizer step (CPU)",
            f"{machine}, {date}, torch {data['meta'].get('torch', '?')}, {data['params'] / 1e6:.1f}M "
            "GPT-shaped fp32 params. Source: `python benchmarks/optimizer_cpu.py` -> "
            "`benchmarks/results/optimizer_cpu.json`.",
            "",
            _md_table(
                ["optimizer", "state B/param", "step ms (median)", "vs AdamW(foreach=True)"],
                [
                    [
                        r["name"],
                        f"{r['state_bytes_per_param']:.3f}",
                        f"{r['step_ms']:.1f}",
                        f"{r['step_ms'] / data['reference_ms']:.2f}x",
                    ]
                    for r in rows
                ],
            ),
            "",
        ]
    )


def section_activation_memory(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    rows = data["rows"]
    base = next((r for r in rows if r["variant"] == "none"), rows[0])
    args = data.get("args", {})
    shape = ", ".join(f"{k} {args[k]}" for k in ("arch", "layers", "dim", "seq", "batch") if k in args)
    out = [
        "## Activation memory",
        f"{machine}, {date}. {shape}. Activation memory = peak minus parameters, gradients and optimizer "
        "state. Source: `python benchmarks/activation_memory.py` -> "
        "`benchmarks/results/activation_memory.json`.",
        "",
        _md_table(
            ["variant", "activation GB", "vs none", "step ms", "vs none"],
            [
                [
                    r["variant"],
                    f"{r['activation_bytes'] / 1e9:.2f}",
                    f"{r['activation_bytes'] / base['activation_bytes']:.2f}x",
                    f"{r['step_ms']:.1f}",
                    f"{r['step_ms'] / base['step_ms']:.2f}x",
                ]
                for r in rows
            ],
        ),
        "",
    ]
    fig, ax, png = _figure("activation_memory", "Activation memory per training step", date, machine)
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


def section_training_parity(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    cfg = data["config"]
    out = [
        "## Training parity",
        f"{machine}, {date}, torch {data['meta'].get('torch', '?')}. A byte-level GPT "
        f"({data['params'] / 1e6:.2f}M params, {cfg['layers']} layers, width {cfg['dim']}) on the Python "
        f"standard library's source, {cfg['steps']} steps, batch {cfg['batch']} x {cfg['seq']} bytes, "
        f"lr {cfg['lr']}, the same seed and batches for every variant. Final loss = mean of the last "
        f"{data['tail']} steps; pass = within "
        f"{100 * data['bound']:.0f}% of torch.optim.AdamW. Source: `python benchmarks/training_parity.py` -> "
        "`benchmarks/results/training_parity.json`.",
        "",
        _md_table(
            ["variant", "final loss", "vs AdamW", "pass", "state B/param", "act. held / saved", "step ms"],
            [
                [
                    v["name"],
                    f"{v['final_loss']:.4f}",
                    f"{100 * v['rel_diff_vs_adamw']:+.2f}%",
                    "yes" if abs(v["rel_diff_vs_adamw"]) <= data["bound"] else "NO",
                    f"{v['state_bytes'] / data['params']:.3f}",
                    f"{v['activation_bytes_held'] / max(1, v['activation_bytes_saved']):.2f}",
                    f"{v['step_ms']:.0f}",
                ]
                for v in data["variants"]
            ],
        ),
        "",
    ]
    fig, ax, png = _figure(
        "training_parity", "Byte-level GPT on the stdlib source: training loss", date, machine
    )
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


def _per_gpu(values) -> str:
    """One number where every rank agrees, else min-max over ranks."""
    values = values if isinstance(values, list) else [values]
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}"


def section_fsdp_train(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    meta, runs, eq = data["meta"], data["runs"], data.get("equivalence", {})
    cfg, world = meta.get("config", {}), meta.get("world_size", "?")
    checks = {
        "fsdp_vs_one_process": "FSDP2 run against the same model and optimizer in one process",
        "dcp_reload": "DCP save, then load into a fresh FSDP2 model",
        "dcp_dir_read": "coatstate.read of the DCP directory (whole tensors)",
    }
    verdict = lambda r: "bit for bit" if r["bit_exact"] else f"DIFFERS in {len(r['differing'])} tensors"
    out = [
        "## FSDP2 training",
        f"{machine} x {world}, {date}, torch {meta.get('torch', '?')}. Source: `torchrun --standalone "
        f"--nproc-per-node {world} benchmarks/fsdp_train.py` -> `benchmarks/results/fsdp_train.json`.",
        "",
        "Equivalence: a small MLP with an uneven row count sharded with fully_shard, trained "
        f"{cfg.get('check_steps', '?')} steps with CompressedAdamW; parameters and every state tensor "
        f"compared bit for bit (fused Triton step used: {'yes' if eq.get('fused_step_used') else 'no'}).",
        "",
        _md_table(
            ["check", "tensors", "result"],
            [[checks.get(k, k), r["tensors"], verdict(r)] for k, r in eq.items() if isinstance(r, dict)],
        ),
        "",
    ]
    if not runs:
        return "\n".join(out)
    out += [
        f"Throughput: a {runs[0]['params'] / 1e9:.2f}B-parameter GPT ({cfg.get('layers', '?')} layers "
        f"x {cfg.get('dim', '?')}), batch {cfg.get('batch', '?')} x seq {cfg.get('seq', '?')} per GPU, "
        f"FSDP2 with bf16 compute and fp32 reduce, median of {cfg.get('steps', '?')} steps after "
        f"{cfg.get('warmup', '?')} warm-up steps; peak = max allocated memory per GPU. coatstate = "
        "CompressedAdamW + compress_activations, coatstate_optimizer = CompressedAdamW alone, torch = "
        "torch.optim.AdamW(fused=True).",
        "",
        _md_table(
            ["", *(r["variant"] for r in runs)],
            [
                ["tokens/s, all GPUs", *(f"{r['tokens_per_s']:,.0f}" for r in runs)],
                ["tokens/s per GPU", *(f"{r['tokens_per_s_per_gpu']:,.0f}" for r in runs)],
                ["step ms", *(f"{r['step_ms']:.1f}" for r in runs)],
                ["peak GiB per GPU", *(_per_gpu(r["peak_gib_per_gpu"]) for r in runs)],
                ["optimizer state MiB per GPU", *(_per_gpu(r["optimizer_state_mib_per_gpu"]) for r in runs)],
            ],
        ),
        "",
    ]
    base = next((r for r in runs if r["variant"] == "torch"), None)
    if base:
        peak = lambda r: max(r["peak_gib_per_gpu"]) / max(base["peak_gib_per_gpu"])
        ratios = [
            f"{r['variant']} {r['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s at "
            f"{peak(r):.2f}x the peak"
            for r in runs
            if r is not base
        ]
        out += ["Against torch: " + "; ".join(ratios) + ".", ""]
    return "\n".join(out)


def section_fp8_linear_train(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    model, results, summary = data["model"], data["results"], data.get("summary", {})
    rows, notes = [], []
    for method, r in results.items():
        if "error" in r:
            notes.append(f"{method} failed: {r['error']}")
            continue
        s, m, big = r["same_batch"], summary.get(method, {}), r.get("largest_batch") or {}
        # {} fallbacks: every linear layer ran in FP8
        mine = [
            f"{k} {'yes' if v is True else 'no' if v is False else v or 'none'}"
            for k, v in (r.get("notes") or {}).items()
        ]
        if not big:
            why = r.get("largest_batch_skipped") or r.get("largest_batch_error") or "same batch only"
            mine.append(f"no largest batch ({why})")
        notes += [f"{method}: {', '.join(mine)}"] if mine else []
        rows.append(
            [
                method,
                f"{s['tokens_per_s']:,.0f}",
                _f(m.get("speedup_vs_bf16")) + "x",
                f"{s['peak_allocated_gib']:.2f}",
            ]
            + [_f(m.get("memory_reduction_vs_bf16")) + "x", big.get("batch", "-")]
            + [_f(big.get("tokens_per_s"), ",.0f")]
        )
    header = "method|tokens/s|speedup vs bf16|peak GiB|memory reduction vs bf16|largest batch|tokens/s there"
    out = [
        "## FP8 linear training",
        f"{machine}, {date}, torch {data.get('torch', '?')}. A {model['params'] / 1e9:.2f}B-parameter "
        f"Llama-style model ({model['layers']} layers x {model['dim']}, seq {model['seq']}), fp32 master "
        "weights under bf16 autocast, the head in bf16 everywhere. bf16 = bf16 GEMMs + fused AdamW; "
        "torchao = torchao float8 (tensorwise scaling, compiled blocks) + fused AdamW; coatstate = "
        "convert_to_fp8 + compress_activations + CompressedAdamW; coatstate_fp8_only = convert_to_fp8 + "
        f"fused AdamW (the FP8 GEMMs alone). Tokens/s = median of {data.get('steps', '?')} synchronized "
        f"steps at batch {data.get('batch', '?')}; memory reduction = bf16 peak / method peak (allocated); "
        "largest batch: doubling, then bisection. Source: "
        f"`{data.get('command', 'python benchmarks/fp8_linear_train.py')}` -> "
        "`benchmarks/results/fp8_linear_train.json`.",
        "",
        _md_table(header.split("|"), rows),
        "",
    ]
    return "\n".join(out + ([f"Notes: {'; '.join(notes)}.", ""] if notes else []))


def section_plan_check(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    plan = data.get("plan", {})
    setup = plan.get("setup", {})
    rows = [
        [r["variant"], quantity, f"{c['predicted'] / 1e9:.3f}", f"{c['measured'] / 1e9:.3f}"]
        + [
            f"{round(100 * c['rel_error'], 2) + 0.0:+.2f}",
            f"±{100 * c['tolerance']:.0f}%",
            "yes" if c["ok"] else "NO",
        ]
        for r in data["rows"]
        for quantity, c in r["checks"].items()
    ]
    return "\n".join(
        [
            "## Memory planner check",
            f"{machine}, {date}, torch {data.get('torch', '?')}. `coatstate plan` for "
            f"{plan.get('model', 'the activation-memory model')}, seq {setup.get('seq', '?')}, batch "
            f"{setup.get('batch', '?')}, {setup.get('param_dtype', '?')} params under bf16 autocast, made on "
            "CPU, against a few measured training steps per variant. Static = parameters + gradients + "
            "optimizer state (bytes allocated before a step); peak = max allocated over the steps; error = "
            "predicted / measured - 1. Source: `python benchmarks/plan_check.py` -> "
            "`benchmarks/results/plan_check.json`. "
            + ("All checks pass." if data.get("all_ok") else "**Not every check passes.**"),
            "",
            _md_table("variant|quantity|predicted GB|measured GB|error %|bound|ok".split("|"), rows),
            "",
        ]
    )


def section_activation_host(data: dict, path: Path) -> str:
    """activation_host.json (CPU) and activation_host_cuda.json in one table."""
    parts, rows = [], []
    for p in (path, path.with_name("activation_host_cuda.json")):
        if not p.exists():
            parts.append(f"`{p.name}`: not measured yet")
            continue
        d = data if p == path else json.loads(p.read_text())
        date, machine = provenance(d, p)
        device = d.get("args", {}).get("device", "?")
        parts.append(f"{device}: {machine}, {date}")
        for r in d["rows"]:
            fwd, bwd = (r.get(f"{k}_us_per_packed_over_hooks") for k in ("fwd", "bwd"))
            rows.append(
                [
                    device,
                    r["variant"],
                    f"{r['fwd_ms']:.2f}",
                    f"{r['bwd_ms']:.2f}",
                    _f(r.get("fwd_us_per_save"), ".1f"),
                ]
                + [_f(r.get("fwd_us_per_op"), ".1f"), "-" if fwd is None else f"{fwd:.1f} / {_f(bwd, '.1f')}"]
            )
    args = data.get("args", {})
    return "\n".join(
        [
            "## Activation compression: host cost",
            "; ".join(parts) + ". Source: `python benchmarks/activation_host.py` (and `--device cuda --out "
            "benchmarks/results/activation_host_cuda.json`).",
            "",
            f"A GPT with {args.get('layers', '?')} layers but tiny tensors (d={args.get('dim', '?')}, seq "
            f"{args.get('seq', '?')}, batch 1; {data.get('ops_per_forward', '?')} torch calls per forward), "
            "so the step is all host work: what compress_activations costs in Python per saved tensor and "
            "per op. On CPU the times are the calling thread's CPU time; on CUDA the forward is the wall "
            "time to issue it and the backward runs to its end. us/save and us/op: forward overhead over "
            "`none` per saved tensor and per op; us/packed: time over `hooks only` per compressed tensor, "
            f"forward / backward. Median of {args.get('rounds', '?')} rounds. On CPU, compress runs the "
            "pure-torch codec (torch twin) or the GPU path's host steps with the kernel launches made no-ops "
            "(no launch); on CUDA the kernel path launches the real kernels.",
            "",
            _md_table("device|variant|fwd ms|bwd ms|us/save|us/op|us/packed".split("|"), rows),
            "",
        ]
    )


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


SECTIONS = {
    "optimizer_step": section_optimizer_step,
    "optimizer_cpu": section_optimizer_cpu,
    "activation_memory": section_activation_memory,
    "checkpoint_io": section_checkpoint_io,
    "training_parity": section_training_parity,
    "fsdp_train": section_fsdp_train,
    "fp8_linear_train": section_fp8_linear_train,
    "plan_check": section_plan_check,
    "activation_host": section_activation_host,
    "fp8_linear_parity": section_fp8_linear_parity,
}
COVERED = {"activation_host_cuda"}  # shown in another file's section


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
