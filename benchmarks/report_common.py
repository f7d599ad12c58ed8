"""Helpers shared by benchmarks/report.py and benchmarks/report_gpu.py: where results and docs live,
the provenance of a result (machine_meta writes it, provenance reads it), number and table formatting,
and figure set-up. A module of its own so that report.py can import the GPU sections and they can use
these helpers without importing report.py back.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
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
    named = [data.get("device_name"), data.get("gpu"), data.get("device")]  # a name, not a bare "cuda"
    machine = meta.get("machine") or meta.get("device") or next((d for d in named if _device_name(d)), None)
    if not machine:
        device = (data.get("args") or {}).get("device")
        torch_version = data.get("torch") or meta.get("torch")
        known = ", ".join(
            x for x in (device and f"device {device}", torch_version and f"torch {torch_version}") if x
        )
        machine = f"machine not recorded ({known})" if known else "machine not recorded"
    load = meta.get("load_average_1min")
    if load is not None and str(meta.get("device") or "").startswith("cuda"):  # a shared GPU host
        machine += f" (host load average {load} at start)"
    elif load is not None:  # CPU timings: how busy the machine was, how many threads took part
        machine += f" (load average {load} at start, {meta.get('threads', '?')} torch threads)"
    return date, machine


def _device_name(device) -> bool:
    return isinstance(device, str) and device.split(":")[0] not in ("cpu", "cuda", "mps", "xpu", "")


def fmt_spread(s: dict | None, spec: str = ".2f", suffix: str = "") -> str:
    """'median [min-max]' of a {median, min, max} dict (the interleaved-rounds JSON); '-' if none."""
    return "-" if not s else f"{s['median']:{spec}}{suffix} [{s['min']:{spec}}-{s['max']:{spec}}]"


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
