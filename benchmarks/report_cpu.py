"""docs/benchmarks.md's CPU sections: the optimizer step, from benchmarks/results/optimizer_cpu.json
(benchmarks/optimizer_cpu.py): per thread count, every variant's state bytes, step time, ratio to
torch's fused AdamW and the bytes-moved floor; then how a CPU differs from the H200 figures."""

from __future__ import annotations

from pathlib import Path

from report_common import _md_table, provenance

REFERENCE = "torch AdamW fused=True"


def _span(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _table(run: dict) -> str:
    rows = []
    for name, r in run["rows"].items():
        ns = r["ns_per_param"]
        rows.append([
            name, f"{r['state_bytes_per_param']:.2f}", f"{r['bytes_moved_per_param']:.1f}", _span(ns),
            f"{r['vs_reference']:.2f}x", f"{r['floor_ns_per_param']:.2f}", f"{ns['median'] / r['floor_ns_per_param']:.1f}",
        ])  # fmt: skip
    header = ["optimizer", "state B/param", "moved B/param", "ns/param", "vs fused", "floor ns/param", "x floor"]
    return _md_table(header, rows)


def _cpu_vs_gpu(data: dict) -> str:
    """The seed question's paragraph: the ratios here beside the H200's (docs: optimizer_step)."""
    runs = data["by_threads"]
    rows = (runs.get("2") or next(iter(runs.values())))["rows"]

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
        "(1.06-1.24x it). Here, at 2 threads, torch's fused AdamW runs at "
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
        f"{machine}, {date}, torch {meta.get('torch', '?')}; {data['params'] / 1e6:.1f}M GPT-shaped fp32 params in {data['tensors']} tensors, random "
        "gradients. Every variant lives in memory at once and they take turns, in an order rotated per "
        "round; ns/param = median [min-max] over the rounds of each round's median step. Moved = bytes a "
        "step must read and write; floor = moved / this machine's measured copy bandwidth (read + write). "
        "Source: `python benchmarks/optimizer_cpu.py` -> `benchmarks/results/optimizer_cpu.json`.",
        "",
    ]
    for threads, run in data["by_threads"].items():
        first = run.get("first_step_s", {})
        out += [
            f"**{threads} thread(s)**: copy bandwidth {run['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"{run['rounds']} rounds of {run['steps_per_round']} steps; first step of a fresh process "
            f"(the C++ step built and loaded): {first.get('cold', float('nan')):.1f} s with an empty cache, "
            f"{first.get('warm', float('nan')):.2f} s with it warm.",
            "",
            _table(run),
            "",
        ]
    return "\n".join(out + [_cpu_vs_gpu(data), ""])


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
