"""The PNG of benchmarks/parity_gpu.py: smoothed train curves and validation points per run, the
reference's seed band shaded."""

from __future__ import annotations

from pathlib import Path


def smooth(xs: list[float]) -> list[float]:
    """Trailing mean over 2% of the run."""
    w, out, acc = max(1, len(xs) // 50), [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def plot(data: dict, path: Path) -> None:
    """Smoothed train curves and validation points per run, the adamw seeds' band shaded grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mtok, band = data["config"]["batch"] * data["config"]["seq"] / 1e6, dict(color="0.6", alpha=0.4)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    refs = [r for r in data["runs"].values() if r["variant"] == "adamw"]
    if len(refs) > 1:
        curves = list(zip(*(smooth(r["train_loss"]) for r in refs), strict=False))  # to the shortest
        xs = [(i + 1) * mtok for i in range(len(curves))]
        axes[0].fill_between(xs, list(map(min, curves)), list(map(max, curves)), **band, label="adamw seeds")
        common = sorted(set.intersection(*({s for s, _ in r["val"]} for r in refs)))
        vals = [[dict(map(tuple, r["val"]))[s] for r in refs] for s in common]
        xs = [s * mtok for s in common]
        axes[1].fill_between(xs, list(map(min, vals)), list(map(max, vals)), **band, label="adamw seeds")
    for key, r in data["runs"].items():
        ys = smooth(r["train_loss"])
        line = axes[0].plot([(i + 1) * mtok for i in range(len(ys))], ys, lw=1, label=key)[0]
        resumes = [s * mtok for s in r["resumed_at"]], [ys[s - 1] for s in r["resumed_at"]]
        axes[0].plot(*resumes, "x", color=line.get_color())
        axes[1].plot([s * mtok for s, _ in r["val"]], [v for _, v in r["val"]], "o-", ms=3, lw=1, label=key)
    for ax, what in zip(axes, ("train loss (smoothed; x: resumed there)", "validation loss"), strict=True):
        ax.set(xlabel="training tokens (M)", ylabel=f"{what}, nats/byte")
        ax.legend(fontsize=8)
        lows = [min(line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata())]
        if lows:  # the late part of the runs, where they differ
            ax.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    m, mib = data["model"], data["corpus"]["total_bytes"] / 2**20
    shape = f"{m['params'] / 1e6:.1f}M-param byte GPT ({m['layers']}x{m['dim']}, seq {m['seq']})"
    fig.suptitle(f"{shape} on {mib:.0f} MiB of Python source, {data['meta']['machine']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
