"""What benchmarks/report.py and the scripts share for reporting: where results and docs live,
the provenance of a result (machine_meta writes it, provenance reads it), number and table
formatting, figure helpers, and the seed statistics and loss-curve figure of parity_gpu.py's
results (parity_gpu.py prints and plots with them too, so the script and the report agree).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import statistics
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


def source(data: dict, path: Path, script: str | None = None) -> str:
    """'Source: `the command` -> `benchmarks/results/NAME.json`.', the command from the result's
    header (its --out left out), or `python benchmarks/SCRIPT.py` where none was recorded."""
    cmd = (data.get("meta") or {}).get("command") or data.get("command")
    cmd = re.sub(r" --out \S+", "", cmd).replace("python3 ", "python ") if cmd else None
    cmd = cmd or f"python benchmarks/{script or path.stem}.py"
    return f"Source: `{cmd}` -> `benchmarks/results/{path.name}`."


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
    for r in rows:
        line = "| " + " | ".join(str(c) for c in r) + " |"
        lines.append(line.replace("|  |", "| |").replace("|  |", "| |"))  # an empty cell: "| |"
    return "\n".join(lines)


# ------------------------------------------------------------ seed statistics of parity_gpu.py
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t, two-sided 95%, by degrees of freedom (more than 9: 2.2 is within 3%)."""


def finished(data: dict, variant: str) -> dict[int, dict]:
    """{seed: record} of the variant's finished runs."""
    runs = data["runs"].values()
    return {r["seed"]: r for r in runs if r["variant"] == variant and r["status"] == "done"}


def interval(xs: list[float]) -> tuple[float, float] | None:
    """95% t interval of the mean of xs (None below two values)."""
    if len(xs) < 2:
        return None
    half = T_975.get(len(xs) - 1, 2.2) * statistics.stdev(xs) / math.sqrt(len(xs))
    mean = statistics.fmean(xs)
    return mean - half, mean + half


def welch_interval_pct(xs: list[float], ref: list[float]) -> tuple[float, float] | None:
    """95% Welch interval of mean(xs) - mean(ref), in percent of mean(ref): each group keeps its own
    seed variance (a recipe that makes runs noisier widens only its own interval). Welch's degrees
    of freedom, rounded down (conservative). None below two values a side."""
    if len(xs) < 2 or len(ref) < 2:
        return None
    a, b = statistics.variance(xs) / len(xs), statistics.variance(ref) / len(ref)
    dof = (a + b) ** 2 / (a**2 / (len(xs) - 1) + b**2 / (len(ref) - 1)) if a + b > 0 else 1
    half = T_975.get(max(1, math.floor(dof)), 2.2) * math.sqrt(a + b)
    diff, scale = statistics.fmean(xs) - statistics.fmean(ref), statistics.fmean(ref) / 100
    return (diff - half) / scale, (diff + half) / scale


def variant_summary(data: dict, variant: str) -> dict | None:
    """Mean, std, spread of the final validation loss; vs AdamW's mean and paired, in percent."""
    runs = finished(data, variant)
    if not runs:
        return None
    losses = [r["final_val_loss"] for r in runs.values()]
    ref = finished(data, "adamw")
    ref_mean = statistics.fmean(r["final_val_loss"] for r in ref.values()) if ref else None
    mean = statistics.fmean(losses)
    paired = [100 * (runs[s]["final_val_loss"] / ref[s]["final_val_loss"] - 1) for s in runs if s in ref]
    paired = paired if variant != "adamw" else []
    # a run that shared its GPU with others measured their load too: no rate from it
    alone = [r for r in runs.values() if r.get("gpu_shared_by", 1) == 1]
    rates = [r["tokens_per_s"] for r in alone if r.get("tokens_per_s")]
    # instability shows in the clipped gradient's norm: its largest value after the first fifth of
    # the run (past warm-up and the early fall), per seed
    late_max = [max(r["grad_norm"][len(r["grad_norm"]) // 5 :]) for r in runs.values() if r.get("grad_norm")]
    out = {
        "variant": variant,
        "grad_norm_late_max": max(late_max) if late_max else None,
        "seeds": sorted(runs),
        "mean": mean,
        "std": statistics.stdev(losses) if len(losses) > 1 else None,
        "spread_pct": 100 * (max(losses) - min(losses)) / mean if len(losses) > 1 else None,
        "vs_adamw_mean_pct": 100 * (mean / ref_mean - 1) if ref_mean else None,
        "welch_ci_pct": welch_interval_pct(losses, [r["final_val_loss"] for r in ref.values()])
        if ref and variant != "adamw"
        else None,
        "paired_pct": paired,
        "paired_mean_pct": statistics.fmean(paired) if paired else None,
        "paired_ci_pct": interval(paired),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "peak_gib": max(r["peak_gib"] for r in runs.values()),
        "opt_state_mb": max(r.get("opt_state_bytes", 0) for r in runs.values()) / 1e6,
    }
    return out


NOISIER = 2.0
"""a variant whose seed std exceeds AdamW's by this factor is noisier: named, and left out of the pool"""


def pooled_noise(data: dict, variants: list[str]) -> dict | None:
    """One run's noise, pooled over the variants with >= 2 finished seeds: the std of a final loss
    about its variant's mean (in % of the grand mean), its degrees of freedom, and the smallest
    difference of two variants' means at 3 seeds each that a 95% t interval resolves. It holds
    when the seed noise is the same for every variant, which is what it estimates; so a variant
    NOISIER than AdamW is left out (`excluded`) instead of widening everyone's floor."""
    groups = {v: [r["final_val_loss"] for r in finished(data, v).values()] for v in variants}
    groups = {v: g for v, g in groups.items() if len(g) > 1}
    ref = groups.get("adamw")
    excluded = [v for v, g in groups.items() if ref and statistics.stdev(g) > NOISIER * statistics.stdev(ref)]
    kept = [g for v, g in groups.items() if v not in excluded]
    dof = sum(len(g) - 1 for g in kept)
    if not dof:
        return None
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in kept)
    grand = statistics.fmean(x for g in kept for x in g)
    std_pct = 100 * math.sqrt(ss / dof) / grand
    resolvable = T_975.get(dof, 2.2) * std_pct * math.sqrt(2 / 3)
    return {
        "std_pct": std_pct,
        "dof": dof,
        "runs": sum(map(len, kept)),
        "resolvable_3_seeds_pct": resolvable,
        "excluded": excluded,
    }


def summaries(data: dict, order: list[str]) -> list[dict]:
    """variant_summary of every variant with a finished run, in `order`."""
    return [s for v in order if (s := variant_summary(data, v))]


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"


def fmt_ci(ci: tuple[float, float] | None) -> str:
    return "-" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


COLUMNS = (
    "variant|seeds|val loss mean|std|vs adamw mean %|95% CI (Welch)|paired % (mean)|paired 95% CI|tokens/s"
    "|peak GiB|opt MB"
)
UPDATE_PAIRS = ("plain/plain", "expand/expand", "plain/expand", "expand/plain")


def reconstruction_rows(data: dict) -> tuple[list[str], list[tuple[int, list[float]]]]:
    """(column names, [(seed, errors)]) of the FP8 reconstruction measured at the end of each
    finished AdamW run: each moment plain and expanded, then the update under each format pair."""
    heads = ["m plain", "m expand", "v plain", "v expand", *(f"update {k}" for k in UPDATE_PAIRS)]
    rows = []
    for seed, r in sorted(finished(data, "adamw").items()):
        if (st := r.get("state_reconstruction")) is not None:
            mo, up = st["moments"], st["update"]
            vals = [mo["m"]["plain"], mo["m"]["expand"], mo["v"]["plain"], mo["v"]["expand"]]
            rows.append((seed, vals + [up[k]["rel_sq_err"] for k in UPDATE_PAIRS]))
    return heads, rows


def print_report(data: dict, order: list[str]) -> None:
    """The seed table (one row per variant) and, from AdamW's final moments, the relative squared
    error of each moment format and of the update m / (sqrt(v) + eps) under each format pair."""
    m, c = data["model"], data["corpus"]
    print(f"\n{m['params'] / 1e6:.1f}M params, {c['total_bytes'] / 2**20:.0f} MiB corpus, batches of "
          f"{data['config']['sampling']}, final validation loss in nats/byte")  # fmt: skip
    rows = summaries(data, order)
    ref = next((r for r in rows if r["variant"] == "adamw"), None)
    if ref and ref["std"] is not None:
        spread = f"std {ref['std']:.4f}, spread (max - min) / mean {ref['spread_pct']:.2f}%"
        print(f"noise floor: adamw at seeds {ref['seeds']}: {spread}")
    if noise := pooled_noise(data, order):
        pooled = f"pooled over {noise['runs']} runs ({noise['dof']} dof): {noise['std_pct']:.2f}% of the loss"
        if noise["excluded"]:
            pooled += f" (left out, over {NOISIER:g}x AdamW's std: {', '.join(noise['excluded'])})"
        print(f"one run's std, {pooled}; 3 seeds a side resolve +-{noise['resolvable_3_seeds_pct']:.2f}%")
    table = [[r["variant"], ",".join(map(str, r["seeds"])), f"{r['mean']:.4f}",
              "-" if r["std"] is None else f"{r['std']:.4f}", fmt_pct(r["vs_adamw_mean_pct"]),
              fmt_ci(r["welch_ci_pct"]), fmt_pct(r["paired_mean_pct"]), fmt_ci(r["paired_ci_pct"]),
              f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-", f"{r['peak_gib']:.1f}",
              f"{r['opt_state_mb']:.1f}"] for r in rows]  # fmt: skip
    cols = COLUMNS.split("|")
    width = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(cols)]
    for row in [cols, *table]:
        print("  ".join(f"{x:>{w}}" for x, w in zip(row, width, strict=True)))
    if partial := [k for k, r in data["runs"].items() if r["status"] != "done"]:
        print(f"unfinished (not in the table): {', '.join(partial)}")
    heads, recon = reconstruction_rows(data)
    if recon:
        print("\nE4M3 groups of 128 on AdamW's final moments: relative squared error")
        print("(update m/v: the update m / (sqrt(v) + eps) with m and v in those formats)")
        print("seed  " + "  ".join(f"{h:<20}" for h in heads))
        for seed, vals in recon:
            print(f"{seed:>4}  " + "  ".join(f"{x:<20.3e}" for x in vals))


# ------------------------------------------------------------------ parity_gpu.py's loss curves
def smooth(xs: list[float]) -> list[float]:
    """Trailing mean over 2% of the run."""
    w, out, acc = max(1, len(xs) // 50), [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def _band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """(mean, low, high) per index, over curves cut to the shortest."""
    cols = list(zip(*curves, strict=False))
    return [sum(c) / len(c) for c in cols], list(map(min, cols)), list(map(max, cols))


def plot_parity(data: dict, path: Path) -> None:
    """Mean curves with their seed band, one colour per variant, train (left) and validation (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mtok = data["config"]["batch"] * data["config"]["seq"] / 1e6
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    by_variant: dict[str, list[dict]] = {}
    for r in data["runs"].values():
        if r["status"] == "done":
            by_variant.setdefault(r["variant"], []).append(r)
    for variant, runs in by_variant.items():
        label = f"{variant} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
        mean, low, high = _band([smooth(r["train_loss"]) for r in runs])
        xs = [(i + 1) * mtok for i in range(len(mean))]
        line = axes[0].plot(xs, mean, lw=1, label=label)[0]
        axes[0].fill_between(xs, low, high, color=line.get_color(), alpha=0.2, lw=0)
        steps = sorted(set.intersection(*({s for s, _ in r["val"]} for r in runs)))
        vals = [[dict(map(tuple, r["val"]))[s] for s in steps] for r in runs]
        mean, low, high = _band(vals)
        xs = [s * mtok for s in steps]
        axes[1].plot(xs, mean, "o-", ms=3, lw=1, color=line.get_color(), label=label)
        axes[1].fill_between(xs, low, high, color=line.get_color(), alpha=0.2, lw=0)
    for ax, what in zip(axes, ("train loss (smoothed)", "validation loss"), strict=True):
        ax.set(xlabel="training tokens (M)", ylabel=f"{what}, nats/byte")
        ax.legend(fontsize=8)
        lows = [min(line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata())]
        if lows:  # the late part of the runs, where they differ
            ax.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    m, mib = data["model"], data["corpus"]["total_bytes"] / 2**20
    shape = f"{m['params'] / 1e6:.1f}M-param byte GPT ({m['layers']}x{m['dim']}, seq {m['seq']})"
    sampling = data["config"].get("sampling", "contiguous stream")
    fig.suptitle(
        f"{shape} on {mib:.0f} MiB of Python source, batches of {sampling}; mean and seed band, "
        f"{data['meta']['machine']}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
