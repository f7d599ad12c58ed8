"""docs/benchmarks.md's section on Llama-2-7B and 13B shapes trained on one 80 GB GPU
(benchmarks/one_gpu.py: one_gpu_7b.json, one_gpu_13b.json), and what it says before they exist."""

from __future__ import annotations

from pathlib import Path

from one_gpu_replan import HEADER as REPLAN_HEADER
from one_gpu_replan import replan
from one_gpu_replan import table_rows as replan_rows
from report_common import _md_table, provenance

GB = 1e9
LABELS = {
    "bf16": "bf16 + torch AdamW fused, fp32 master",
    "coatstate": "coatstate: FP8Linear + CompiledActivations + CompressedAdamW(master_bits=24)",
    "release": "coatstate + gradient release",
    "4bit": "coatstate + gradient release + 4-bit moments",
}
HEADER = [
    "setup",
    "moments GB",
    "master GB",
    "activations GB (batch 1)",
    "peak GB, batch 1 (planner, error)",
    "tokens/s, batch 1: median [min-max]",
    "largest batch (planner's)",
    "peak GB there (planner, error)",
    "tokens/s there",
]
ABOUT = (
    "Llama-2 shapes (benchmarks/llama.py, random init; 7B: 32 x 4096, 32 heads, SwiGLU 11008; 13B: "
    "40 x 5120, 40 heads, 13824; vocab 32000, seq 2048) trained on ONE GPU, capped at 80 GB (1e9 "
    "bytes) with torch.cuda.set_per_process_memory_fraction on a larger card, beside COAT's Table 7 "
    "(one 80 GB GPU, Llama-2-7B: BF16 out of memory, COAT 79.3 GB and 5,906 tokens/s; 13B needs 2 "
    "GPUs). Setups, each in its own process: bf16 weights + torch AdamW(fused=True) on fp32 masters "
    "(COAT's BF16 baseline; where it runs out of memory is named); coatstate's recipe (FP8Linear, "
    "blocks compiled with CompiledActivations, CompressedAdamW master_bits=24 on bf16 weights); the "
    "same with gradient release; and with release and 4-bit moments. Activations: what a forward "
    "allocates and holds for backward; peak: torch.cuda.max_memory_allocated over the timed steps; "
    "tokens/s: median [min-max] of the timed steps; the largest batch is the largest a bounded "
    "search (from the planner's prediction, one batch at a time, within a time budget) ran; each "
    "peak has coatstate.planner's prediction beside it."
)


def _gb(b) -> str:
    return "-" if b is None else f"{b / GB:.2f}"


def _peak(r: dict) -> str:
    plan = r.get("predicted", {}).get("peak")
    if "peak_bytes" not in r:
        return f"- ({_gb(plan)})"
    return f"{_gb(r['peak_bytes'])} ({_gb(plan)}, {100 * r['peak_error']:+.1f}%)"


def _speed(r: dict) -> str:
    t = r["tokens_per_s"]
    return f"{t['median']:,.0f} [{t['min']:,.0f}-{t['max']:,.0f}]"


def _row(name: str, res: dict) -> list[str]:
    label = LABELS.get(name, name)
    b1, big = res.get("batch1"), res.get("largest")
    if b1 is None:
        oom = res.get("oom")
        why = f"out of memory at batch 1 in {oom['phase']}" if oom else res.get("status", "no result")
        plan = (res.get("predicted_batch1") or {}).get("peak")
        return [
            label,
            why,
            "",
            "",
            f"- ({_gb(plan)})",
            "",
            f"- ({res.get('predicted_max_batch', '-')})",
            "",
            "",
        ]
    cut = " (time)" if res.get("search", {}).get("cut_short_by_budget") else ""
    return [
        label,
        _gb(b1["moment_bytes"]),
        _gb(b1["master_bytes"]),
        _gb(b1["activation_bytes"]),
        _peak(b1),
        _speed(b1),
        f"{big['batch']}{cut} ({res.get('predicted_max_batch', '-')})",
        _peak(big),
        _speed(big),
    ]


def section_one_gpu(data: dict, path: Path) -> str:
    """benchmarks/one_gpu.py: a table per model, its setups as rows."""
    date, machine = provenance(data, path)
    meta = data["meta"]
    cap = meta.get("memory_cap") or {}
    capped = (
        f"capped at {cap['cap_bytes'] / GB:.0f} GB of {cap['total_bytes'] / GB:.1f} GB"
        if cap.get("cap_bytes")
        else "not capped"
    )
    parts = []
    for name, entry in data["models"].items():
        c = entry["config"]
        parts += [
            f"## One GPU: Llama {name} ({c['params'] / 1e9:.2f}B params, seq {c['seq']})",
            f"{machine}, {date}, torch {meta.get('torch', '?')}, memory {capped}. {ABOUT} Source: "
            f"`benchmarks/one_gpu.py` -> `benchmarks/results/{path.name}`.",
            "",
            _md_table(HEADER, [_row(n, r) for n, r in entry["setups"].items()]),
            "",
        ]
        replanned = replan(data, name)
        if replanned:  # the planner as it is now, against every measured peak
            worst = max(abs(r["error"]) for r in replanned)
            parts += [
                f"The planner now (coatstate.planner, on the CPU: `benchmarks/one_gpu_replan.py`; "
                f"`tests/planner/test_against_gpu_peaks.py` holds each within 3%) against every measured peak: "
                f"the largest error is {100 * worst:.1f}%. The run's own predictions (made by the "
                "planner before issue #52's fixes) are beside them.",
                "",
                _md_table(REPLAN_HEADER, replan_rows(replanned)),
                "",
            ]
        notes = [
            f"{LABELS.get(n, n)}: {r['status']}" for n, r in entry["setups"].items() if r["status"] != "ok"
        ]
        if entry.get("paper"):
            notes.append(f"Paper: {entry['paper']}.")
        parts += [*notes, ""] if notes else []
    return "\n".join(parts)


def missing_one_gpu(name: str) -> str:
    """What the section says before the run: the benchmark, its table, and the command."""
    model = name.removeprefix("one_gpu_")
    return "\n".join(
        [
            f"## One GPU: Llama {model}",
            f"{ABOUT} Columns: {', '.join(HEADER[1:])}.",
            "",
            f"No `benchmarks/results/{name}.json` yet: run `bash benchmarks/gpu_one_gpu.sh {model}` on "
            f"one GPU (or `python benchmarks/one_gpu.py --models {model}`).",
            "",
        ]
    )
