"""docs/benchmarks.md sections for FP8Linear's width sweep (fp8_width.json)."""

from __future__ import annotations

from pathlib import Path

from report_common import provenance


def section_fp8_width(data: dict, path: Path) -> str:
    """Per width: bf16 and FP8 MLP times with their floors, the paired ratio, and the crossover."""
    date, machine = provenance(data, path)
    args, peaks = data["meta"]["args"], data["matmul_tflops"]
    rate = lambda k: f"{peaks[k]:.0f}" if peaks.get(k) else "-"
    out = [
        f"## From which width FP8Linear pays (`{path.name}`)",
        f"{machine}, {date}: one MLP d -> 4d -> d, forward and backward, {args['tokens']:,} tokens, "
        f"{'eager' if args['eager'] else 'torch.compile (inductor defaults)'}; median of "
        f"{data['meta']['rounds']} interleaved rounds [min-max]. Floor: the GEMM FLOPs at the matmul "
        f"rate measured in the same run (bf16 {rate('bf16')}, FP8 {rate('fp8')} TFLOP/s). "
        "Source: `python benchmarks/fp8_width.py`.",
        "",
        "| width | bf16 ms | floor | FP8Linear ms | floor | bf16 / FP8 |",
        "|---|---|---|---|---|---|",
    ]
    cell = lambda w: f"{w['median']:.3f} [{w['min']:.3f}-{w['max']:.3f}]" if w else "failed"
    floor = lambda f: f"{f:.3f}" if f else "-"
    by = {(r["width"], r["variant"]): r for r in data["rows"]}
    for d in sorted({r["width"] for r in data["rows"]}):
        b, f, r = by[d, "bf16"], by[d, "fp8"], data["ratios"].get(str(d))
        ratio = f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"
        out.append(f"| {d} | {cell(b['wall_ms'])} | {floor(b['floor_ms'])} | {cell(f['wall_ms'])} | "
                   f"{floor(f['floor_ms'])} | {ratio} |")  # fmt: skip
    pays = data["fp8_pays_from_width"]
    verdict = "FP8Linear is faster at no width"
    if pays:
        verdict = f"FP8Linear is faster at every width from {pays} on"
    ratios = {int(d): r for d, r in data["ratios"].items() if r}
    first = next((d for d in sorted(ratios) if ratios[d]["min"] > 1.0), None)  # faster in every round
    if first is not None and first != pays:
        slower = [d for d in sorted(ratios) if d > first and ratios[d]["median"] <= 1.0]
        verdict += (f"; first faster in every round at {first} (slower at every narrower width), "
                    f"slower again at {', '.join(map(str, slower))}")  # fmt: skip
    out += ["", verdict + ". `convert_to_fp8` keeps layers narrower than its `min_features` (default "
            "1536, the first width that paid) in high precision."]  # fmt: skip
    return "\n".join(out + [""])
