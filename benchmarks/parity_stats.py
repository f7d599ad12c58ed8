"""Seed statistics of parity_gpu.py's results: per variant the mean and std of the final validation
loss over its finished seeds, its distance to AdamW's mean, and the difference paired by seed (a
variant at seed s sees AdamW:s's initial weights and batches) with a 95% t interval. Shared by
parity_gpu.py's table and report.py's sections, so both print the same numbers."""

from __future__ import annotations

import math
import statistics

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
