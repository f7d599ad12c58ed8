"""docs/benchmarks.md's section on the fused AdamW kernel's static cost (benchmarks/kernel_static.py:
compiled for sm_90 without a GPU), one table per Triton version."""

from __future__ import annotations

from pathlib import Path

from report_common import provenance


def section_kernel_static(data: dict, path: Path) -> str:
    """Per variant of the step: registers, spills, barriers, shuffles and the SASS a thread runs
    when nothing is rare (the hot path), in all and on the integer pipe."""
    date, _ = provenance(data, path)
    # (results before the launch was recorded were all of the launch of the time: 8 groups x 4 warps)
    launch = data.get("launch", {"groups_per_program": 8, "num_warps": 4, "max_registers": None})
    cap = f", registers capped at {launch['max_registers']}" if launch["max_registers"] else ""
    out = [
        f"## Fused step, static cost under Triton {data['triton']} (`{path.name}`)",
        f"Compiled for {data['target']} on the CPU, {date}; gradients {data['grad']}; bfloat16 weights, "
        f"master_bits=24, groups of 128, {launch['groups_per_program']} groups x {launch['num_warps']} "
        f"warp{'s' if launch['num_warps'] > 1 else ''} per program{cap} (8 elements a thread). Hot: SASS "
        "instructions a thread runs when nothing is rare; alu: those on the integer/compare pipe. "
        "The H200 runs Triton 3.6. Source: `python benchmarks/kernel_static.py` (docstring: how to run "
        "it under another Triton).",
        "",
        "| variant | registers | spill B | SASS | hot | hot alu | BAR | SHFL | shared B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in data["variants"].items():
        s, spill = r["sass"], r["spill_stores_B"] + r["spill_loads_B"]
        cells = [name, r["registers"], spill, s["instructions"], s["hot_path"], s["hot_path_alu"]]
        cells += [s["ops"]["BAR"], s["ops"]["SHFL"], r["shared_B"]]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out + [""])
