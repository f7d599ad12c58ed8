"""What benchmarks/report.py and the scripts share for reporting: where results and docs live,
the provenance of a result (common.result_meta writes its header, provenance reads it), number
and table formatting, the seed statistics and loss-curve figure of parity_gpu.py's results, and
the tables a script prints as the report renders them (parity_gpu.py, optimizers_cpu_train.py).
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
IMG = DOCS / "img"


def provenance(data: dict, path: Path) -> tuple[str, str]:
    """(date, machine) of a result file, from its meta block or, failing that, git and its args."""
    top = {k: data[k] for k in ("date", "machine") if isinstance(data.get(k), str)}
    meta = {**top, **(data.get("meta") or {})}
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
        threads = f", {meta['threads']} torch threads" if meta.get("threads") else ""  # (some list several)
        machine += f" (load average {load} at start{threads})"
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


def fmt_num(value, spec: str = ".2f", missing: str = "-") -> str:
    """A number formatted by spec, or `missing` where an older JSON lacks the field."""
    return missing if value is None else format(value, spec)


def md_table(header: list[str], rows: list[list]) -> str:
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
    return {
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


# ------------------------------------------------ optimizers_cpu_train.py's table
OPTIMIZER_NAMES = {"sgd": "SGD (nesterov)", "lion": "Lion", "muon": "Muon (hidden 2-D weights)"}


def optimizers_cpu_train_table(rows: list[dict]) -> list[str]:
    """The table of benchmarks/optimizers_cpu_train.py's summary rows (the script prints it too)."""
    out = [
        "| optimizer | state B/param (reference -> compressed) | reference val loss | compressed val loss "
        "| reference seed spread | compressed - reference [95% CI] | within spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["diff_ci95"]
        out.append(
            f"| {OPTIMIZER_NAMES[r['optimizer']]} | {r['ref_bytes_per_param']:.2f} -> "
            f"{r['ours_bytes_per_param']:.3f} | {r['ref_val_loss']:.4f} | {r['ours_val_loss']:.4f} "
            f"| {r['ref_seed_spread']:.4f} | {r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] "
            f"| {'yes' if r['within_spread'] else 'no'} |"
        )
    return out
