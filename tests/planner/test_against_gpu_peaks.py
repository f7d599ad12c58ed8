"""coatstate.planner against the GPU: every peak benchmarks/one_gpu.py measured (Llama-2-7B and 13B
shapes on one 80 GB GPU) planned again, now, on the CPU, within 3% (issue #52)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from one_gpu_replan import HEADER, replan, table_rows  # noqa: E402

RESULTS = [ROOT / "benchmarks" / "results" / f"one_gpu_{m}.json" for m in ("7b", "13b")]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_planned_peaks_are_within_3_percent_of_the_measured_ones(path):
    doc = json.loads(path.read_text())
    for model in doc["models"]:
        rows = replan(doc, model)
        assert len(rows) >= 3, f"{path.name} {model}: measured runs missing"
        print(f"\n{path.name} {model}: " + " | ".join(HEADER))
        for cells in table_rows(rows):
            print(" | ".join(cells))
        for r in rows:
            assert abs(r["error"]) <= 0.03, r
            # the activations column is the mechanism, not a remainder: within 3% on its own
            assert abs(r["predicted_activations"] / r["measured_activations"] - 1) <= 0.03, r
