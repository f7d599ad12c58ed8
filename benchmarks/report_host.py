"""The sections of docs/benchmarks.md on host (Python) time: activation compression's host cost per
saved tensor (activation_host, CPU and CUDA in one table) and the primitive calls it is made of
(host_primitives). benchmarks/report.py imports them into its SECTIONS."""

from __future__ import annotations

import json
from pathlib import Path

from report_common import _f, _md_table, fmt_spread, provenance


def _cpu_and_cuda(data: dict, path: Path, parts: list[str]):
    """(device, result) for a CPU result and its `_cuda` sibling, where each exists; appends each
    one's provenance (or that it is missing) to `parts`."""
    for p in (path, path.with_name(f"{path.stem}_cuda.json")):
        if not p.exists():
            parts.append(f"`{p.name}`: not measured yet")
            continue
        d = data if p == path else json.loads(p.read_text())
        date, machine = provenance(d, p)
        device = d.get("args", {}).get("device", "?")
        parts.append(f"{device}: {machine}, {date}, median of {d.get('args', {}).get('rounds', '?')} rounds")
        yield device, d


def section_activation_host(data: dict, path: Path) -> str:
    """activation_host.json (CPU) and activation_host_cuda.json in one table."""
    parts, rows = [], []
    for device, d in _cpu_and_cuda(data, path, parts):
        for r in d["rows"]:
            fwd, bwd = (r.get(f"{k}_us_per_packed_over_hooks") for k in ("fwd", "bwd"))
            rows.append(
                [
                    device,
                    r["variant"],
                    f"{r['fwd_ms']:.2f}",
                    f"{r['bwd_ms']:.2f}",
                    _f(r.get("fwd_us_per_save"), ".1f"),
                ]
                + [_f(r.get("fwd_us_per_op"), ".1f"), "-" if fwd is None else f"{fwd:.1f} / {_f(bwd, '.1f')}"]
            )
    args = data.get("args", {})
    return "\n".join(
        [
            "## Activation compression: host cost",
            "; ".join(parts) + ". Source: `python benchmarks/activation_host.py` (and `--device cuda --out "
            "benchmarks/results/activation_host_cuda.json`).",
            "",
            f"A GPT with {args.get('layers', '?')} layers but tiny tensors (d={args.get('dim', '?')}, seq "
            f"{args.get('seq', '?')}, batch 1; {data.get('ops_per_forward', '?')} torch calls per forward), "
            "so the step is all host work: what compress_activations costs in Python per saved tensor and "
            "per op. On CPU the times are the calling thread's CPU time; on CUDA the forward is the wall "
            "time to issue it and the backward runs to its end. us/save and us/op: forward overhead over "
            "`none` per saved tensor and per op; us/packed: time over `hooks only` per compressed tensor, "
            "forward / backward. On CPU, compress runs the "
            "pure-torch codec (torch twin) or the GPU path's host steps with the kernel launches made no-ops "
            "(no launch); on CUDA the kernel path launches the real kernels. The floors are hook pairs that "
            "do less than compress_activations must: identity hooks return what they get; keep floor wraps "
            "each save in a kept-tensor record (detached, with its version); inspect floor also makes the "
            "reads every decision starts from (the caller's frame, grad_fn, storage pointer, strides).",
            "",
            _md_table("device|variant|fwd ms|bwd ms|us/save|us/op|us/packed".split("|"), rows),
            "",
        ]
    )


def section_host_primitives(data: dict, path: Path) -> str:
    """host_primitives.json (CPU) and host_primitives_cuda.json in one table."""
    parts, names, columns = [], [], []
    for device, d in _cpu_and_cuda(data, path, parts):
        cells = {r["call"]: fmt_spread(r["us_per_call"], ".2f") for r in d["rows"]}
        names += [n for n in cells if n not in names]
        columns.append((device, cells))
    rows = [[n] + [cells.get(n, "-") for _, cells in columns] for n in names]
    return "\n".join(
        [
            "## Host time per primitive call",
            "; ".join(parts) + ". Source: `python benchmarks/host_primitives.py` (and `--device cuda --out "
            "benchmarks/results/host_primitives_cuda.json`).",
            "",
            "What the calls that compress_activations' hot path is made of cost the host that issues them, "
            "in microseconds per call [min-max] (64 x 1024 bfloat16 tensors, small enough that the GPU "
            "keeps up). An eager step with compression is host-bound, so its overhead is a count of these "
            "calls times their cost (on CPU an eager op's time is mostly its arithmetic).",
            "",
            _md_table(["call"] + [f"{device} us" for device, _ in columns], rows),
            "",
        ]
    )
