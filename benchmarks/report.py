"""python benchmarks/report.py

Collects the JSON the benchmark scripts write (benchmarks/results/*.json) into docs/benchmarks.md,
with PNG figures in docs/img/: step time against the bandwidth floor, activation memory bars,
checkpoint sizes and training loss curves. Every table and figure names the machine and the date
the JSON records; where a file does not record them, the date its JSON was last committed is used
and the machine is given as what the file says (or "not recorded"). A missing result is skipped
with a line saying so; a result this script does not know is listed with its top-level numbers.
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
    machine = meta.get("machine") or meta.get("device")
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


def _figure(name: str, title: str, date: str, machine: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
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


def plot_loss_curves(data: dict, path: Path | None = None) -> str:
    """Loss per step of each training_parity variant (light) and its 20-step running mean."""
    date, machine = provenance(data, RESULTS / "training_parity.json")
    fig, ax, default = _figure(
        "training_parity", "Byte-level GPT on the stdlib source: training loss", date, machine
    )
    window = 20
    for v in data["variants"]:
        losses = v["losses"]
        line = ax.plot(losses, alpha=0.25, linewidth=0.8)[0]
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(losses))
        ]
        ax.plot(
            smooth, color=line.get_color(), linewidth=1.6, label=f"{v['name']} (final {v['final_loss']:.4f})"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.legend()
    ax.set_ylim(top=min(ax.get_ylim()[1], data["variants"][0]["losses"][0] * 1.05))
    return _save(fig, path or default)


def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def section_optimizer_step(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    meta = data.get("meta", {})
    rows = data["rows"]
    bw = meta.get("copy_bandwidth_Bps")
    out = [
        "## Optimizer step (GPU)",
        f"{machine}, {date}, torch {meta.get('torch', '?')}"
        + (f", copy bandwidth measured in the same run {bw / 1e12:.2f} TB/s" if bw else "")
        + ". Source: `python benchmarks/optimizer_step.py` -> `benchmarks/results/optimizer_step.json`. "
        "Floor = bytes the step must move / copy bandwidth.",
        "",
        _md_table(
            ["optimizer", "params dtype", "state B/param", "step ms (median)", "floor ms", "x floor"],
            [
                [
                    r["name"],
                    r.get("dtype", "?"),
                    f"{r['state_bytes_per_param']:.3f}",
                    f"{r['step_ms']:.2f}",
                    f"{r['floor_ms']:.2f}",
                    f"{r['step_ms'] / r['floor_ms']:.2f}",
                ]
                for r in rows
            ],
        ),
        "",
    ]
    for dtype in dict.fromkeys(r.get("dtype", "?") for r in rows):
        sub = [r for r in rows if r.get("dtype", "?") == dtype]
        fig, ax, png = _figure(
            f"optimizer_step_{dtype}", f"Optimizer step vs bandwidth floor ({dtype} params)", date, machine
        )
        y = range(len(sub))
        ax.barh(y, [r["step_ms"] for r in sub], color="tab:blue", label="measured step")
        ax.scatter(
            [r["floor_ms"] for r in sub],
            y,
            color="tab:red",
            marker="|",
            s=300,
            zorder=3,
            label="bandwidth floor",
        )
        ax.set_yticks(
            list(y), [f"{r['name']} ({r['state_bytes_per_param']:.2f} B/param)" for r in sub], fontsize=7
        )
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median)")
        ax.legend(fontsize=8)
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
        plot_loss_curves(data),
        "",
    ]
    return "\n".join(out)


def _loss_runs(data: dict) -> dict[str, list[float]]:
    """Loss curves one level down: {"runs": {name: {"losses": [...]}}} or a list of such dicts."""
    found = {}
    for key, value in data.items():
        items = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        )
        for name, run in items:
            if isinstance(run, dict) and isinstance(run.get("losses"), list) and run["losses"]:
                found[str(run.get("name", f"{key} {name}" if isinstance(name, int) else name))] = run[
                    "losses"
                ]
    return found


def section_unknown(name: str, data: dict, path: Path) -> str:
    """A result without its own section: its top-level numbers, and its loss curves if it has any."""
    date, machine = provenance(data, path)
    scalars = [[k, v] for k, v in data.items() if isinstance(v, (int, float, str, bool))]
    out = [
        f"## {name}",
        f"{machine}, {date}. `benchmarks/results/{path.name}` (no dedicated section; top-level values):",
        "",
        _md_table(["key", "value"], scalars) if scalars else "(none)",
        "",
    ]
    runs = _loss_runs(data)
    if runs:
        fig, ax, png = _figure(name, f"{name}: training loss", date, machine)
        for label, losses in runs.items():
            ax.plot(losses, linewidth=1.0, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
        out += [_save(fig, png), ""]
    return "\n".join(out)


SECTIONS = {
    "optimizer_step": section_optimizer_step,
    "optimizer_cpu": section_optimizer_cpu,
    "activation_memory": section_activation_memory,
    "checkpoint_io": section_checkpoint_io,
    "training_parity": section_training_parity,
}


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
        if path.stem not in SECTIONS:
            parts.append(section_unknown(path.stem, json.loads(path.read_text()), path))
    DOCS.mkdir(exist_ok=True)
    (DOCS / "benchmarks.md").write_text("\n".join(parts).rstrip() + "\n")
    print(f"wrote {(DOCS / 'benchmarks.md').relative_to(ROOT)} and figures in {IMG.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
