"""The current coatstate.planner's peak beside every peak benchmarks/one_gpu.py measured.

    python benchmarks/one_gpu_replan.py benchmarks/results/one_gpu_7b.json [...]

Plans each recorded model config again, for the same setups (one_gpu.variants), so that a change
to the planner is checked against the GPU's measurements without a GPU
(tests/planner/test_against_gpu_peaks.py, docs/benchmarks.md's one-GPU section).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from one_gpu import GB, LABELS, make_plan, predicted
from report_common import md_table

from coatstate.models import ModelConfig


def measured_runs(entry: dict) -> list[tuple[str, dict]]:
    """(setup, run) for every run of a model entry that fit and has an allocator peak."""
    runs = []
    for name, res in entry["setups"].items():
        for r in [res.get("batch1"), *res.get("probes", [])]:
            if r and r.get("fits", True) and "peak_bytes" in r:
                runs.append((name, r))
    return runs


def replan(doc: dict, model: str) -> list[dict]:
    """One row per measured (setup, batch) of `model`: measured and predicted bytes."""
    entry = doc["models"][model]
    cfg = ModelConfig(**{k: v for k, v in entry["config"].items() if k != "params"})
    cap = (doc["meta"].get("memory_cap") or {}).get("cap_bytes") or 80 * GB
    runs = measured_runs(entry)
    if not runs:  # (a CPU --smoke run has no allocator peaks)
        return []
    the_plan = make_plan(cfg, cap, sorted({name for name, _ in runs}))
    rows = []
    for name, r in runs:
        pred = predicted(the_plan, name, r["batch"])
        rows.append(
            {
                "setup": name,
                "batch": r["batch"],
                "measured_peak": r["peak_bytes"],
                "measured_activations": r["activation_bytes"],
                "predicted_peak": pred["peak"],
                "predicted_activations": pred["activations"],
                "error": pred["peak"] / r["peak_bytes"] - 1,
                "recorded_error": r.get("peak_error"),
            }
        )
    return rows


HEADER = (
    "setup|batch|measured peak GB|planner now GB|error|planner at run time (error)|activations "
    "measured / planned GB"
).split("|")


def table_rows(rows: list[dict]) -> list[list[str]]:
    return [
        [
            LABELS.get(r["setup"], r["setup"]),
            str(r["batch"]),
            f"{r['measured_peak'] / GB:.2f}",
            f"{r['predicted_peak'] / GB:.2f}",
            f"{100 * r['error']:+.1f}%",
            "-" if r["recorded_error"] is None else f"{100 * r['recorded_error']:+.1f}%",
            f"{r['measured_activations'] / GB:.2f} / {r['predicted_activations'] / GB:.2f}",
        ]
        for r in rows
    ]


def main(argv=None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        doc = json.loads(Path(path).read_text())
        for model in doc["models"]:
            print(f"{path}: {model}\n" + md_table(HEADER, table_rows(replan(doc, model))))


if __name__ == "__main__":
    main()
