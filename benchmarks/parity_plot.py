"""The PNG of benchmarks/parity_gpu.py: per variant, the mean over its finished seeds of the
smoothed train curve and of the validation points, with a band from the lowest to the highest seed."""

from __future__ import annotations

from pathlib import Path


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


def plot(data: dict, path: Path) -> None:
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
