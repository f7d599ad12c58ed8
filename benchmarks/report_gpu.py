"""The sections of docs/benchmarks.md whose results come from the GPU machine: optimizer step (GPU),
FSDP2 training, FP8 linear training, the memory planner check and activation
compression's kernels. benchmarks/report.py imports them into its SECTIONS.
"""

from __future__ import annotations

from pathlib import Path

from report_common import _f, _figure, _md_table, _save, fmt_spread, provenance


def section_optimizer_step(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    meta = data.get("meta", {})
    rows = data["rows"]
    bw = meta.get("copy_bandwidth_Bps")

    def step(r: dict) -> float:  # the headline: back to back where recorded, else the synced median
        return r.get("pipelined_ms") or r["step_ms"]

    def mb(r: dict) -> float | None:
        return None if r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / 1e6

    if meta.get("method") == "rounds":
        return _optimizer_rounds(data, rows, date, machine, bw)
    header = "optimizer|params dtype|state B/param|step ms (back to back)|synced ms|floor ms|x floor"
    table = [
        [r["name"], r.get("dtype", "?"), f"{r['state_bytes_per_param']:.3f}", _f(r.get("pipelined_ms"))]
        + [f"{r['step_ms']:.2f}", f"{r['floor_ms']:.2f}", f"{step(r) / r['floor_ms']:.2f}"]
        + [_f(r.get("first_step_s")), _f(mb(r), ".0f")]
        for r in rows
    ]
    old = sum(r.get("pipelined_ms") is None for r in rows)
    out = [
        "## Optimizer step (GPU)",
        f"{machine}, {date}, torch {meta.get('torch', '?')}"
        + (f", copy bandwidth measured in the same run {bw / 1e12:.2f} TB/s" if bw else "")
        + ". Source: `python benchmarks/optimizer_step.py` -> `benchmarks/results/optimizer_step.json`. "
        "Floor = bytes the step must move / copy bandwidth; x floor = step ms / floor ms. Step ms is the "
        "GPU time per step with steps run back to back, as in a training loop where the host queues the "
        "next step while the GPU works; synced ms is the median of single steps each followed by a "
        "synchronisation, so it also counts the host's launch time wherever the GPU would idle. First "
        "step s includes Triton compilation; peak extra MB is the memory a step allocates.",
        "",
        _md_table(header.split("|") + ["first step s", "peak extra MB"], table),
        "",
    ]
    if old:
        out += [f"{old} row(s) from an older run record no back-to-back time: x floor uses synced ms.", ""]
    for dtype in dict.fromkeys(r.get("dtype", "?") for r in rows):
        sub = [r for r in rows if r.get("dtype", "?") == dtype]
        fig, ax, png = _figure(
            f"optimizer_step_{dtype}", f"Optimizer step vs bandwidth floor ({dtype} params)", date, machine
        )
        y = [2.5 * i for i in range(len(sub))]
        ax.barh([v - 0.45 for v in y], [step(r) for r in sub], height=0.9, label="step (back to back)")
        ax.barh([v + 0.45 for v in y], [r["floor_ms"] for r in sub], height=0.9, color="0.7", label="floor")
        for v, r in zip(y, sub, strict=True):
            ax.text(
                step(r),
                v - 0.45,
                f" {step(r):.1f} ms, {step(r) / r['floor_ms']:.2f}x floor",
                va="center",
                fontsize=7,
            )
        ax.set_yticks(y, [f"{r['name']} ({r['state_bytes_per_param']:.2f} B/param)" for r in sub], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")  # the peers are 10-50x off the floor; on a log axis the fast rows stay readable
        ax.margins(x=0.3)
        ax.set_xlabel("ms per step, log scale (floor = bytes moved / copy bandwidth)")
        ax.legend(fontsize=8, loc="lower right")
        out += [_save(fig, png), ""]
    return "\n".join(out)


def _optimizer_rounds(data: dict, rows: list[dict], date: str, machine: str, bw) -> str:
    """optimizer_step.py's interleaved-rounds JSON: per-step medians [min-max over rounds]."""
    meta = data["meta"]
    header = (
        "optimizer|params dtype|state B/param|step ms|GPU ms|floor ms|x floor|vs torch AdamW|first step s"
    )
    table = [
        [r["name"], r["dtype"], f"{r['state_bytes_per_param']:.3f}", fmt_spread(r["step_ms_spread"], ".2f")]
        + [fmt_spread(r["gpu_ms_spread"], ".2f"), f"{r['floor_ms']:.2f}"]
        + [f"{r['pipelined_ms'] / r['floor_ms']:.2f}"]
        + [fmt_spread(r["vs_torch"], ".3f", "x"), _f(r.get("first_step_s"))]
        for r in rows
    ]  # fmt: skip
    return "\n".join(
        [
            "## Optimizer step (interleaved rounds)",
            f"{machine}, {date}, torch {meta.get('torch', '?')}"
            + (f", copy bandwidth measured in the same run {bw / 1e12:.2f} TB/s" if bw else "")
            + f". {meta.get('rounds')} rounds x {meta.get('steps')} samples of {meta.get('burst')} steps run "
            "back to back (one sync per sample), every optimizer of a dtype built at once and the order "
            "rotated per round; per step, median [min-max over rounds]. Step ms = wall time per step, GPU "
            "ms = kernel time of one profiled sample per step; floor = bytes the step must move / copy "
            "bandwidth; vs torch AdamW = per-round ratio of step ms to torch's fused AdamW on the same "
            "dtype. Source: `python benchmarks/optimizer_step.py` -> "
            "`benchmarks/results/optimizer_step.json`.",
            "",
            _md_table(header.split("|"), table),
            "",
        ]
    )


def _per_gpu(values) -> str:
    """One number where every rank agrees, else min-max over ranks."""
    values = values if isinstance(values, list) else [values]
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}"


def section_fsdp_train(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    meta, runs, eq = data["meta"], data["runs"], data.get("equivalence", {})
    cfg, world = meta.get("config", {}), meta.get("world_size", "?")
    checks = {
        "fsdp_vs_one_process": "FSDP2 run against the same model and optimizer in one process",
        "dcp_reload": "DCP save, then load into a fresh FSDP2 model",
        "dcp_dir_read": "coatstate.read of the DCP directory (whole tensors)",
    }
    verdict = lambda r: "bit for bit" if r["bit_exact"] else f"DIFFERS in {len(r['differing'])} tensors"
    out = [
        "## FSDP2 training",
        f"{machine} x {world}, {date}, torch {meta.get('torch', '?')}. Source: `torchrun --standalone "
        f"--nproc-per-node {world} benchmarks/fsdp_train.py` -> `benchmarks/results/fsdp_train.json`.",
        "",
        "Equivalence: a small MLP with an uneven row count sharded with fully_shard, trained "
        f"{cfg.get('check_steps', '?')} steps with CompressedAdamW; parameters and every state tensor "
        f"compared bit for bit (fused Triton step used: {'yes' if eq.get('fused_step_used') else 'no'}).",
        "",
        _md_table(
            ["check", "tensors", "result"],
            [[checks.get(k, k), r["tensors"], verdict(r)] for k, r in eq.items() if isinstance(r, dict)],
        ),
        "",
    ]
    if not runs:
        return "\n".join(out)
    out += [
        f"Throughput: a {runs[0]['params'] / 1e9:.2f}B-parameter GPT ({cfg.get('layers', '?')} layers "
        f"x {cfg.get('dim', '?')}), batch {cfg.get('batch', '?')} x seq {cfg.get('seq', '?')} per GPU, "
        f"FSDP2 with bf16 compute and fp32 reduce, median of {cfg.get('steps', '?')} steps after "
        f"{cfg.get('warmup', '?')} warm-up steps; peak = max allocated memory per GPU. coatstate = "
        "CompressedAdamW + compress_activations, coatstate_optimizer = CompressedAdamW alone, torch = "
        "torch.optim.AdamW(fused=True).",
        "",
        _md_table(
            ["", *(r["variant"] for r in runs)],
            [
                ["tokens/s, all GPUs", *(f"{r['tokens_per_s']:,.0f}" for r in runs)],
                ["tokens/s per GPU", *(f"{r['tokens_per_s_per_gpu']:,.0f}" for r in runs)],
                ["step ms", *(f"{r['step_ms']:.1f}" for r in runs)],
                ["peak GiB per GPU", *(_per_gpu(r["peak_gib_per_gpu"]) for r in runs)],
                ["optimizer state MiB per GPU", *(_per_gpu(r["optimizer_state_mib_per_gpu"]) for r in runs)],
            ],
        ),
        "",
    ]
    base = next((r for r in runs if r["variant"] == "torch"), None)
    if base:
        peak = lambda r: max(r["peak_gib_per_gpu"]) / max(base["peak_gib_per_gpu"])
        ratios = [
            f"{r['variant']} {r['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s at "
            f"{peak(r):.2f}x the peak"
            for r in runs
            if r is not base
        ]
        out += ["Against torch: " + "; ".join(ratios) + ".", ""]
    return "\n".join(out)


def section_fp8_linear_train(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    model, results, summary = data["model"], data["results"], data.get("summary", {})
    rows, notes = [], []
    for method, r in results.items():
        if "error" in r:
            notes.append(f"{method} failed: {r['error']}")
            continue
        s, m, big = r["same_batch"], summary.get(method, {}), r.get("largest_batch") or {}
        # {} fallbacks: every linear layer ran in FP8
        mine = [
            f"{k} {'yes' if v is True else 'no' if v is False else v or 'none'}"
            for k, v in (r.get("notes") or {}).items()
        ]
        if not big:
            why = r.get("largest_batch_skipped") or r.get("largest_batch_error") or "same batch only"
            mine.append(f"no largest batch ({why})")
        notes += [f"{method}: {', '.join(mine)}"] if mine else []
        spread = m.get("speedup_vs_bf16_spread")  # (--rounds: paired per round, median [min-max])
        rows.append(
            [
                method,
                f"{s['tokens_per_s']:,.0f}",
                fmt_spread(spread, suffix="x") if spread else _f(m.get("speedup_vs_bf16")) + "x",
                f"{s['peak_allocated_gib']:.2f}",
                _f(m.get("own_peak_gib")),  # (fp8_linear_train.own_peak_gib, in its summary)
            ]
            + [_f(m.get("memory_reduction_vs_bf16")) + "x", big.get("batch", "-")]
            + [_f(big.get("tokens_per_s"), ",.0f")]
        )
    header = (
        "method|tokens/s|speedup vs bf16|peak GiB|own peak GiB|memory reduction vs bf16|largest batch|"
        "tokens/s there"
    )
    out = [
        "## FP8 linear training" + ("" if path.stem == "fp8_linear_train" else f" ({path.stem})"),
        f"{machine}, {date}, torch {data.get('torch', '?')}. A {model['params'] / 1e9:.2f}B-parameter "
        f"Llama-style model ({model['layers']} layers x {model['dim']}, seq {model['seq']}), fp32 master "
        "weights under bf16 autocast, the head in bf16 everywhere. bf16 = bf16 GEMMs + fused AdamW "
        "(eager; bf16_compiled: its blocks torch.compile'd); torchao = torchao float8 (tensorwise "
        "scaling, compiled blocks) + fused AdamW; coatstate = convert_to_fp8 + compress_activations + "
        "CompressedAdamW, eager; coatstate_compiled = convert_to_fp8 + CompressedAdamW with compiled "
        "blocks; coatstate_compiled_ca = the same inside compress_activations (entered outside the "
        "compiled blocks); coatstate_compiled_graphs = convert_to_fp8 + CompressedAdamW with blocks "
        "compiled by coatstate.CompiledActivations (FP8 saved activations inside the graphs, no "
        "hooks; _all: also norm inputs and attention's v/out packed, as compress_activations packs "
        "them around compiled blocks); coatstate_fp8_only = convert_to_fp8 + fused AdamW (the FP8 "
        "GEMMs alone). "
        "Speedups are against eager bf16, as the issue asks. "
        + (
            f"Interleaved rounds (benchmarks/rounds.py): {data['rounds']} rounds of {data.get('steps')} "
            "steps, every method built at once; tokens/s = median over rounds, speedup = median "
            "[min-max] of the per-round ratios; own peak = what a warm-up step adds plus the method's "
            "own parameters and optimizer state; no batch search. "
            if data.get("method") == "rounds"
            else ""
        )
        + f"Tokens/s = median of {data.get('steps', '?')} synchronized "
        f"steps at batch {data.get('batch', '?')}; own peak = peak allocated minus what earlier methods "
        "left allocated when the method started (on the H200, torch 2.11, each compiled method left "
        "~3.5 GiB alive after dynamo's reset: its blocks' fp32 parameters by size; not reproduced on "
        "CPU); memory reduction = bf16 own peak / method own peak; a method that started with that "
        "leftover searched its largest batch in 3.5 GiB less; "
        "largest batch: doubling, then bisection. Source: "
        f"`{data.get('command', 'python benchmarks/fp8_linear_train.py')}` -> "
        f"`benchmarks/results/{path.name}`.",
        "",
        _md_table(header.split("|"), rows),
        "",
    ]
    return "\n".join(out + ([f"Notes: {'; '.join(notes)}.", ""] if notes else []))


def section_plan_check(data: dict, path: Path) -> str:
    date, machine = provenance(data, path)
    plan = data.get("plan", {})
    setup = plan.get("setup", {})
    rows = [
        [r["variant"], quantity, f"{c['predicted'] / 1e9:.3f}", f"{c['measured'] / 1e9:.3f}"]
        + [
            f"{round(100 * c['rel_error'], 2) + 0.0:+.2f}",
            f"±{100 * c['tolerance']:.0f}%",
            "yes" if c["ok"] else "NO",
        ]
        for r in data["rows"]
        for quantity, c in r["checks"].items()
    ]
    return "\n".join(
        [
            "## Memory planner check",
            f"{machine}, {date}, torch {data.get('torch', '?')}. `coatstate plan` for "
            f"{plan.get('model', 'the activation-memory model')}, seq {setup.get('seq', '?')}, batch "
            f"{setup.get('batch', '?')}, {setup.get('param_dtype', '?')} params under bf16 autocast, made on "
            "CPU, against a few measured training steps per variant. Static = parameters + gradients + "
            "optimizer state (bytes allocated before a step); peak = max allocated over the steps; error = "
            "predicted / measured - 1. Source: `python benchmarks/plan_check.py` -> "
            "`benchmarks/results/plan_check.json`. "
            + ("All checks pass." if data.get("all_ok") else "**Not every check passes.**"),
            "",
            _md_table("variant|quantity|predicted GB|measured GB|error %|bound|ok".split("|"), rows),
            "",
        ]
    )


def section_table7(data: dict, path: Path) -> str:
    """benchmarks/table7.py: Llama-2-7B shapes under FSDP2 beside COAT's Table 7."""
    date, machine = provenance(data, path)
    meta, paper = data["meta"], data["paper"]
    model = meta["model"]
    rows = []
    for name, s in data["setups"].items():
        if "batch" not in s:
            rows.append([name] + ["failed: " + str(s.get("error", "?"))] + [""] * 7)
            continue
        b, big, r = s["batch"], s.get("largest") or {}, data["ratios"].get(name, {})
        rows.append(
            [
                name,
                f"{max(b['optimizer_gib_per_rank']):.2f}",
                f"{max(b['activation_gib_per_rank']):.2f}",
                f"{max(b['peak_gib_per_rank']):.2f}",
                f"{r.get('peak_reduction_at_batch', float('nan')):.2f}x",
                f"{b['tokens_per_s_per_gpu']:,.0f}",
                str(big.get("batch", "-")),
                f"{big['tokens_per_s_per_gpu']:,.0f}" if big else "-",
                f"{r.get('speed_at_largest', float('nan')):.2f}x",
            ]
        )
    for p in paper.values():
        rows.append(
            [
                f"paper: {p['name']}",
                _f(p.get("optimizer_gb")),
                _f(p.get("activation_gb")),
                _f(p.get("peak_gb")),
                f"{paper['bf16']['peak_gb'] / p['peak_gb']:.2f}x",
                "-",
                str(p["batch"]),
                f"{p['tokens_per_s']:,}",
                f"{p['tokens_per_s'] / paper['bf16']['tokens_per_s']:.2f}x",
            ]
        )
    head = "setup|optimizer GiB/GPU|activations GiB/GPU|peak GiB/GPU|peak reduction vs bf16|"
    head += f"tokens/s/GPU at batch {meta['batch']}|largest batch|tokens/s/GPU there|speed vs bf16 there"
    shape = (
        f"{model['layers']} layers of Llama-2-7B's shape (d {model['dim']}, {model['heads']} heads, "
        f"SwiGLU {model['hidden']}, seq {model['seq']}; {model['params'] / 1e9:.2f}B params)"
    )
    return "\n".join(
        [
            "## Llama-2-7B shapes beside COAT's Table 7",
            f"{machine} x {meta['world_size']}, {date}, torch {meta.get('torch', '?')}. FSDP2, {shape}, "
            f"batch {meta['batch']} per GPU. The paper's rows: Llama-2-7B, 32 layers, 4 GPUs, GB. The "
            "largest batch is bounded by the search's limits (see the JSON). Source: "
            f"`benchmarks/table7.py` -> `benchmarks/results/{path.name}`.",
            "",
            _md_table(head.split("|"), rows),
            "",
        ]
    )


def section_master_train(data: dict, path: Path) -> str:
    """benchmarks/master_train.py: the 1B Llama end to end per master-weight mode."""
    cfg, rows = data["config"], data["rows"]
    ref = rows.get("fp32 + torch AdamW", {}).get("tokens_per_s")
    table = []
    for name, r in rows.items():
        b = r["bytes_per_param"]
        table.append(
            [
                name,
                f"{r['tokens_per_s']:,.0f} [{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}]",
                f"{r['tokens_per_s'] / ref:.3f}x" if ref else "",
                _f(r.get("peak_gib"), ".2f"),
                str(r.get("largest_batch_predicted", "")),
                f"{b['weights']:.2f} + {b['correction']:.2f} + {b['gradients']:.2f} + {b['moments']:.2f}",
                f"{b['total']:.2f}",
                _f(r["first_step_s"], ".1f"),
            ]
        )
    head = [
        "variant",
        "tokens/s [min-max]",
        "vs fp32",
        "peak GiB",
        "largest batch*",
        "w + corr + grad + mom",
        "B/param",
        "first s",
    ]
    return "\n".join(
        [
            "## A 1B Llama end to end per master-weight mode (GPU)",
            f"{cfg['device']}, {data['date']}: {cfg['model_params'] / 1e9:.2f}B params, batch "
            f"{cfg['batch']} x {cfg['seq']}, eager, {cfg['rounds']} interleaved rounds of {cfg['steps']} "
            "timed steps (median [min-max]). *Largest batch: a linear fit of the peaks at batch 1 and at "
            "this batch to the card's memory (predicted, not tried). Source: "
            "`python benchmarks/master_train.py` -> "
            f"`benchmarks/results/{path.name}`.",
            "",
            _md_table(head, table),
            "",
        ]
    )


def section_checkpoint_scale(data: dict, path: Path) -> str:
    """benchmarks/checkpoint_scale.py: per-rank saves, blocking vs async vs DCP async_save."""
    meta, rows = data["meta"], data["rows"]

    table = [
        [
            str(r["world_size"]),
            r["variant"],
            fmt_spread(r["blocked_s"], ".3f"),
            fmt_spread(r["total_s"], ".3f"),
            fmt_spread(r["gbps"]),
        ]
        for r in rows
    ]
    first = rows[0]
    return "\n".join(
        [
            f"## Per-rank checkpoints at scale ({meta['device']})",
            f"{meta['machine']}, {meta['date']}: {first['params'] / 1e6:.0f}M parameters, "
            f"{first['bytes'] / 1e6:.0f} MB per checkpoint, {data['args']['rounds']} interleaved rounds, "
            "median [min-max]. `floor` writes and fsyncs a file of the same size from one cache-hot 1 MiB "
            "block (the disk's bandwidth in the same run); `floor_mem` writes it from a host buffer as "
            "large as the file (runs before this variant was added have none); `blocked` is the time the "
            "training loop waits per save. Source: "
            "`python benchmarks/checkpoint_scale.py` -> "
            f"`benchmarks/results/{path.name}`.",
            "",
            _md_table(["ranks", "variant", "blocked s", "total s", "GB/s"], table),
            "",
            *_checkpoint_phases(rows),
        ]
    )


def _checkpoint_phases(rows: list[dict]) -> list[str]:
    """Rank 0's time per save by phase (runs that recorded them), as checkpoint_scale.py prints it."""
    timed = [r for r in rows if "phases_s" in r]
    if not timed:
        return []
    names = list(timed[0]["phases_s"])
    table = [
        [
            str(r["world_size"]),
            r["variant"],
            *(f"{r['phases_s'][n]:.3f}" for n in names),
            f"{r['total_s']['median']:.3f}",
        ]
        for r in timed
    ]
    return [
        "Where rank 0's time goes, median s per save: `stage` queues the copies to host memory, "
        "`rank_file` hashes and writes this rank's file, `root` writes the root (the commit); "
        "`cleanup` removes the replaced checkpoint's files on a thread after the commit, outside "
        "`total`; the rest of `total` waits (for the device-to-host copies, for the other ranks).",
        "",
        _md_table(["ranks", "variant", *names, "total"], table),
        "",
    ]


def section_checkpoint_load(data: dict, path: Path) -> str:
    """benchmarks/checkpoint_load.py: load time per layout, this tree (and an older one)."""
    meta, rows = data["meta"], data["rows"]
    table = [
        [
            r["tree"],
            r["layout"],
            fmt_spread(r["load_s"], ".3f"),
            fmt_spread(r["floor_s"], ".3f"),
            f"{r['bytes'] / 1e6:.1f}",
        ]
        for r in rows
    ]
    old = f" against `--old` ({data['args']['old']})" if data["args"].get("old") else ""
    return "\n".join(
        [
            "## Loading a checkpoint",
            f"{meta['machine']}, {meta['date']}: a CompressedAdamW state (gpt_shapes scale "
            f"{data['args']['scale']}) loaded into an optimizer of the same format{old}, "
            f"{data['args']['rounds']} rounds of one process per tree, interleaved; median [min-max] over "
            "rounds of each process's median of 3 loads. `floor` = reading the files' bytes (from a RAM "
            f"disk). Source: `python benchmarks/checkpoint_load.py` -> `benchmarks/results/{path.name}`.",
            "",
            _md_table(["tree", "layout", "load s", "floor s", "MB"], table),
            "",
        ]
    )


def section_kernel_breakdown(data: dict, path: Path) -> str:
    """kernel_breakdown.py: GPU kernel ms per kernel family of one profiled step per variant."""
    date, machine = provenance(data, path)
    variants = data["variants"]
    names = list(variants)
    families = sorted(
        {k for v in variants.values() for k in v["families_ms"]},
        key=lambda k: -max(v["families_ms"].get(k, 0.0) for v in variants.values()),
    )
    base = variants[names[0]]["families_ms"]
    rows = [["**kernel ms**", *(f"**{variants[n]['kernel_ms']:.2f}**" for n in names), ""]]
    for k in families[:16]:
        ms = [variants[n]["families_ms"].get(k, 0.0) for n in names]
        rows.append([f"`{k}`", *(f"{m:.2f}" for m in ms), f"{ms[-1] - base.get(k, 0.0):+.2f}"])
    args = data.get("args", {})
    flags = (
        f" --methods {args['methods']}"
        if args.get("what") == "fp8"
        else f' --variants "{args.get("variants")}"'
    )
    note = f" Note: {data['note']}." if data.get("note") else ""
    return "\n".join(
        [
            f"## GPU kernel time by family: {data.get('title', path.stem)}",
            f"{machine}, {date}, torch {data.get('meta', {}).get('torch', '?')}. One profiled step per "
            "variant after warm-up steps, variants run one after another (not interleaved: compare the "
            "families within a run). Kernel ms = the sum of the step's CUDA kernels (the optimizer's "
            "profiler span left out); the last column is the last variant minus the first. Source: "
            f"`python benchmarks/kernel_breakdown.py {args.get('what')}{flags}` -> "
            f"`benchmarks/results/{path.name}`.{note}",
            "",
            _md_table(["family", *names, "last - first"], rows),
            "",
        ]
    )


def section_activation_kernels(data: dict, path: Path) -> str:
    """activation_kernels.py: pack/unpack bandwidth beside a copy, the best unpack rewrite, host cost."""
    date, machine = provenance(data, path)
    rows = []
    for s in data["shapes"]:
        by_name = {k["kernel"]: k for k in s["kernels"]}
        rewrites = [k for k in s["kernels"] if k.get("layout")]
        best = max(rewrites, key=lambda k: k["tb_per_s"]) if rewrites else None
        cells = [f"{s['rows']}x{s['cols']}", f"{s['floor_bytes'] / 1e6:.0f}"]
        for name in ("clone (2+2 B/elem)", "pack_groups_flat", "unpack_groups_flat"):
            k = by_name[name]
            cells.append(f"{k['us']:.1f} us, {k['tb_per_s']:.2f} TB/s")
        cells.append(f"{best['tb_per_s']:.2f} TB/s ({best['kernel']})" if best else "-")
        cells.append("yes" if all(k.get("bit_exact", True) for k in rewrites) else "NO")
        rows.append(cells)
    host = [[h["call"], f"{h['host_us']:.1f} [{h['min']:.1f}-{h['max']:.1f}]"] for h in data.get("host", [])]
    note = f" Note: {data['note']}." if data.get("note") else ""
    header = "bf16 tensor|floor MB each way|x.clone()|pack|unpack|best unpack rewrite|rewrites bit-exact"
    return "\n".join(
        [
            "## Activation pack/unpack kernels: bandwidth and host cost",
            f"{machine}, {date}. The per-group kernels compress_activations launches per saved tensor, "
            "median of 40 calls timed with CUDA events, beside x.clone() of the same tensor; floor = the "
            "bytes a pack or an unpack must move (2 + 1 + 1/16 per element). Best unpack rewrite: the "
            "fastest of 20 other ways of writing the unpack (1-D or [groups, 16] tiles, block sizes, warps, "
            "with or without the interpreter's integer rounding to bfloat16). Each call is timed alone "
            "between two events, so the smallest tensor's row counts launch latency too (the rewrites "
            "launch through triton's full path, the kernels through their cached launcher). Host us "
            "per call: a 256x256 tensor, 500 calls without a sync, median [min-max] of 5 rounds. Source: "
            f"`python benchmarks/activation_kernels.py` -> `benchmarks/results/{path.name}`.{note}",
            "",
            _md_table(header.split("|"), rows),
            "",
            _md_table(["call", "host us per call"], host),
            "",
        ]
    )
