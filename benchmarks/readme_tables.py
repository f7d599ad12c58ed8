"""The README's number tables, generated from benchmarks/results/*.json (report.py writes them
between `<!-- table:NAME -->` and `<!-- /table:NAME -->` markers of README.md, docs/accuracy.md and
docs/performance.md): the accuracy of
each recipe against AdamW (parity_gpu.json) and the headline bytes and step times
(whole_state_step.json, optimizer_step.json, activation_memory.json, checkpoint_io.json), and
the step time of the saved-activation recipes (activation_memory.json, activation_memory_llama.json,
fp8_linear_train_rounds.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from parity_stats import NOISIER, finished, fmt_ci, fmt_pct, summaries
from report_common import RESULTS, ROOT, fmt_spread

RECIPES = {  # variant: (what a user runs, the bound on its mean vs AdamW's mean, in percent)
    "compressed": ("`CompressedAdamW` (FP8 moments)", 0.3),
    "master24": ("bf16 model + `CompressedAdamW` (`master_bits=24`)", 0.3),
    "compressed_ca": ("+ `CompiledActivations`", 0.5),
    "full": ("+ `FP8Linear` (the full recipe)", 0.7),
    "fp4": ("`CompressedAdamW`, 4-bit moments (`e2m1` / `ue3m1_sqrt`; opt-in)", 0.3),
    "fp4_v": ("`CompressedAdamW`, FP8 m + 4-bit v (`ue3m1_sqrt`; opt-in)", 0.3),
    "compressed_ca_attn_group": (
        "diagnostic: + `CompiledActivations` with q, k in FP8 (the default until now)",
        None,
    ),
    "full_attn_group": ("diagnostic: the full recipe with q, k in FP8 (the default until now)", None),
    "compressed_ca_v_out_group": ('+ `CompiledActivations(attention_v_out="group")` (an option)', 0.5),
    "compressed_ca_norm_group": ('+ `CompiledActivations(norm="group")` (an option)', 0.5),
    "fp4_nearest": ("diagnostic: 4-bit moments, v rounded to the nearest level (until now)", None),
    "fp4_v_nearest": ("diagnostic: FP8 m + 4-bit v, v rounded to the nearest level (until now)", None),
    "compressed_plain": ("diagnostic: no range expansion", None),
    "compressed_expand": ("diagnostic: expansion on both moments", None),
    "master16": ("diagnostic: `master_bits=16`", None),
}
MIN_SEEDS = 3
NOISE_BAR_PCT = 0.6
"""the spread of AdamW's own seeds the accuracy issue asks of the harness"""


def _verdict(row: dict, bound: float | None) -> str:
    """yes / no only where the 95% Welch interval of the recipe's mean against AdamW's lies wholly
    on one side of its bound; otherwise "not resolved" with the side its mean is on."""
    if bound is None:
        return "diagnostic"
    if len(row["seeds"]) < MIN_SEEDS:
        return f"not decided: {len(row['seeds'])} of {MIN_SEEDS} seeds"
    lo, hi = row["welch_ci_pct"]
    if hi <= bound:
        return "yes"
    if lo > bound:
        return f"no (bound +{bound}%)"
    side = "within" if row["vs_adamw_mean_pct"] <= bound else "above"
    return f"not resolved (mean {side} +{bound}%)"


def _run_dates(data: dict) -> str:
    """The days the runs were made on (a merged file holds several sessions' invocations)."""
    days = sorted({inv["date"][:10] for inv in data.get("invocations", [])} or {data["meta"]["date"][:10]})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def accuracy_table(data: dict) -> str:
    """Per recipe: final validation loss over seeds, vs AdamW, memory, and whether it keeps AdamW's
    accuracy (its mean within the recipe's bound of AdamW's mean, at >= 3 seeds)."""
    rows = {r["variant"]: r for r in summaries(data, ["adamw", *RECIPES])}
    ref = rows.get("adamw")
    if ref is None:
        return "No finished AdamW run in `benchmarks/results/parity_gpu.json` yet."
    m, meta = data["model"], data["meta"]
    head = (
        f"{meta['machine']}, {_run_dates(data)}: a {m['params'] / 1e6:.0f}M-param byte-level GPT, "
        f"{data['config']['tokens'] / 1e6:.0f}M tokens per run, batches of {data['config']['sampling']}; "
        f"final loss on every held-out file, nats/byte. AdamW's seeds {ref['seeds']}: "
        f"{ref['mean']:.4f} ± {ref['std']:.4f}: one run's std is {100 * ref['std'] / ref['mean']:.2f}% of "
        f"the loss, spread {ref['spread_pct']:.2f}% (the harness aims at <= {NOISE_BAR_PCT}%). Each recipe's "
        "interval is a 95% Welch interval of its mean against AdamW's, from both groups' own seeds."
    )
    noisy = [
        f"{RECIPES[v][0].removeprefix('diagnostic: ')} (std {100 * r['std'] / r['mean']:.2f}%)"
        for v, r in rows.items()
        if v in RECIPES and r["std"] is not None and r["std"] > NOISIER * ref["std"]
    ]
    if noisy:
        head += f" Noisier than AdamW across seeds (over {NOISIER:g}x its std): {'; '.join(noisy)}."
    cols = "recipe|seeds|val loss|spread|vs AdamW's mean [95% CI]|paired by seed [95% CI]|"
    cols += "optimizer MB|peak GiB|keeps AdamW's accuracy?"
    out = [head, "", "| " + cols.replace("|", " | ") + " |", "|---" * (cols.count("|") + 1) + "|"]
    ref_loss = f"{ref['mean']:.4f} ± {ref['std']:.4f} | {_spread(ref)}"
    out.append(f"| torch AdamW (fused, fp32) | {len(ref['seeds'])} | {ref_loss} | | | "
               f"{ref['opt_state_mb']:.0f} | {ref['peak_gib']:.1f} | (reference) |")  # fmt: skip
    for variant, (label, bound) in RECIPES.items():
        if (r := rows.get(variant)) is None:
            continue
        std = f" ± {r['std']:.4f}" if r["std"] is not None else ""
        out.append(
            f"| {label} | {len(r['seeds'])} | {r['mean']:.4f}{std} | {_spread(r)} | "
            f"{fmt_pct(r['vs_adamw_mean_pct'])}% "
            f"{fmt_ci(r['welch_ci_pct'])} | "
            f"{fmt_pct(r['paired_mean_pct'])}% {fmt_ci(r['paired_ci_pct'])} | {r['opt_state_mb']:.0f} | "
            f"{r['peak_gib']:.1f} | {_verdict(r, bound)} |"
        )
    if line := expansion_line(data):
        out += ["", line]
    missing = [RECIPES[v][0] for v, (_, b) in RECIPES.items() if b is not None and v not in rows]
    if missing:
        out += ["", "Not run yet: " + "; ".join(missing) + "."]
    return "\n".join(out)


def accuracy_summary(data: dict) -> str:
    """The README's short form of accuracy_table: the recipes a user picks (no diagnostics), each
    mean against AdamW's with its bound; the statistics live in docs/accuracy.md."""
    rows = {r["variant"]: r for r in summaries(data, ["adamw", *RECIPES])}
    ref = rows.get("adamw")
    if ref is None:
        return "No finished AdamW run in `benchmarks/results/parity_gpu.json` yet."
    m, meta = data["model"], data["meta"]
    counts = sorted({len(r["seeds"]) for r in rows.values()})
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    out = [
        f"{meta['machine']}, {_run_dates(data)}: a {m['params'] / 1e6:.0f}M-param byte-level GPT, "
        f"{data['config']['tokens'] / 1e6:.0f}M tokens per run, {seeds} seeds per recipe; "
        "final validation loss in nats/byte, mean ± std.",
        "",
        "| recipe | val loss | vs AdamW [95% CI] | bound | optimizer MB | peak GiB |",
        "|---|---|---|---|---|---|",
        f"| torch AdamW (fused, fp32) | {ref['mean']:.4f} ± {ref['std']:.4f} | | | "
        f"{ref['opt_state_mb']:.0f} | {ref['peak_gib']:.1f} |",
    ]
    for variant, (label, bound) in RECIPES.items():
        if bound is None or (r := rows.get(variant)) is None:
            continue
        std = f" ± {r['std']:.4f}" if r["std"] is not None else ""
        out.append(
            f"| {label} | {r['mean']:.4f}{std} | {fmt_pct(r['vs_adamw_mean_pct'])}% "
            f"{fmt_ci(r['welch_ci_pct'])} | +{bound}% | {r['opt_state_mb']:.0f} | {r['peak_gib']:.1f} |"
        )
    return "\n".join(out)


def _spread(row: dict) -> str:
    """(max - min) / mean of a variant's final losses over its seeds, in % ("" for one seed)."""
    return f"{row['spread_pct']:.2f}%" if row["spread_pct"] is not None else ""


def expansion_line(data: dict) -> str | None:
    """How many times more plain E4M3 loses of AdamW's real final moments than expanded E4M3 (the
    range over the AdamW runs), per moment and for the update m / (sqrt(v) + eps)."""
    states = [
        r["state_reconstruction"] for r in finished(data, "adamw").values() if "state_reconstruction" in r
    ]
    if not states:
        return None
    ratio = {
        "m": [st["moments"]["m"]["plain"] / st["moments"]["m"]["expand"] for st in states],
        "v": [st["moments"]["v"]["plain"] / st["moments"]["v"]["expand"] for st in states],
        "the update m / (sqrt(v) + eps)": [
            st["update"]["plain/plain"]["rel_sq_err"] / st["update"]["expand/expand"]["rel_sq_err"]
            for st in states
        ],
    }
    digits = lambda xs: 1 if max(xs) < 10 else 0
    parts = [
        f"{min(xs):.{digits(xs)}f}-{max(xs):.{digits(xs)}f}x more of {what}" for what, xs in ratio.items()
    ]
    return (
        f"On the final float32 moments of these {len(states)} AdamW runs, E4M3 groups of 128 without range "
        f"expansion lose (in squared error) {', '.join(parts)} than with expansion on both moments."
    )


WHOLE_STATE_ROWS = {  # whole_state_step.json row name: the label a user reads
    "torch AdamW fused, fp32 params": "torch AdamW fused, fp32 params",
    "FlashOptim FlashAdamW, bf16, master 24": "FlashOptim 0.1.4, bf16, 24-bit master",
    "coatstate CompressedAdamW, fp32 params": "**coatstate**, fp32 params",
    "coatstate CompressedAdamW, bf16, master_bits=24": "**coatstate**, bf16, `master_bits=24` (bf16 default)",
    "coatstate CompressedAdamW, bf16, master_bits=32": "**coatstate**, bf16, `master_bits=32` (exact)",
    "torchao AdamW4bit, bf16 params (no master)": "torchao 0.18 AdamW4bit, bf16, no master",
    "coatstate CompressedAdamW, bf16, master_bits=24, 4-bit moments": "**coatstate**, bf16, 24-bit master, "
    '4-bit moments (`"e2m1"` / `"ue3m1_sqrt"`, opt-in)',
    "coatstate CompressedAdamW, bf16, master_bits=24, FP8 m + 4-bit v": "**coatstate**, bf16, 24-bit master, "
    'FP8 m + 4-bit v (`"ue3m1_sqrt"`, opt-in)',
}


def expansion_cost_ms(step: dict) -> float:
    """What range expansion adds to the fp32-param step in optimizer_step.json (on minus off)."""
    ms = {r["name"]: r["pipelined_ms"] for r in step["rows"] if r["dtype"] == "float32"}
    return ms["coatstate CompressedAdamW (expansion on)"] - ms["coatstate CompressedAdamW (expansion off)"]


def expansion_note(meta: dict, step: dict) -> str:
    """What the coatstate rows' FP8 moments ran with: expansion on (the default) or off."""
    if meta.get("expand"):
        return "coatstate's FP8 moments at the defaults (range expansion on for both)."
    return (
        "coatstate rows measured with range expansion off (the default then); turning it on added "
        f"{expansion_cost_ms(step):.2f} ms to the fp32 step in `optimizer_step.py`'s run of "
        f"{step['meta']['date'][:10]} (one round, docs/benchmarks.md)."
    )


def _default_launch_name(name: str) -> str:
    """A row measured under --configs is named "... [GPPxWARPS]": the headline shows the launch
    config a user gets (the kernel's defaults) under the plain name, and drops the others."""
    from coatstate.kernels.adamw_fused import GROUPS_PER_PROGRAM, MAX_REGISTERS, NUM_WARPS
    from optimizer_step import launch_config_name

    base, _, config = name.partition(" [")
    if not config:
        return name
    return base if config == f"{launch_config_name(GROUPS_PER_PROGRAM, NUM_WARPS, MAX_REGISTERS)}]" else ""


def headline_table(whole: dict, step: dict, activations: dict, checkpoint: dict) -> str:
    """Whole training state per parameter and step time on the 1.31B set; activation memory and
    checkpoint size in one line each."""
    meta = whole["meta"]
    out = [
        f"Optimizer step, {meta.get('machine', meta['device'])}, {meta['date']}, 1.31B GPT-shaped params, "
        "median of "
        f"{meta['rounds']} interleaved rounds [min-max]; bytes per parameter of weights + master "
        "correction + gradients + moments; floor = bytes the step must move / copy bandwidth. "
        + expansion_note(meta, step),
        "",
        "| optimizer | state B/param | with gradient release | step ms | floor ms |",
        "|---|---|---|---|---|",
    ]
    for r in whole["rows"]:
        if (label := WHOLE_STATE_ROWS.get(_default_launch_name(r["name"]))) is None:
            continue
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] == r["floor_ms"] else ""  # NaN: the peer's layout
        lo, hi = r["spread_ms"]
        out.append(
            f"| {label} | {r['total_B']:.2f} | {r['total_with_release_B']:.2f} | "
            f"{r['step_ms']:.2f} [{lo:.2f}-{hi:.2f}] | {floor} |"
        )
    act = next(r for r in activations["rows"] if r["variant"] == "cudagraphs: CompiledActivations")
    wall, am = act["wall_vs_base"], activations["meta"]
    ck = checkpoint["ratio_compressed_vs_torch_adamw"]
    out += [
        "",
        f"Saved activations (GPT-2-medium shape, {am['machine']}, {am['date'][:10]}, "
        f"`CompiledActivations(cudagraphs=True)`): **{act['activation_vs_base']:.2f}x** the memory at "
        f"{wall['median']:.3f}x [{wall['min']:.3f}-{wall['max']:.3f}] the step's wall time. "
        f"Checkpoints: `coatstate.save` of a {checkpoint['params'] / 1e6:.0f}M-param state is "
        f"**{ck:.3f}x** the bytes of `torch.save(AdamW.state_dict())`.",
    ]
    return "\n".join(out)


ACTIVATION_ROWS = {  # activation_memory.json variant: what a user runs
    "compress_activations": "eager, `compress_activations()`",
    "compiled: CompiledActivations": "compiled blocks, `CompiledActivations()`",
    "cudagraphs: CompiledActivations": "compiled blocks, `CompiledActivations(cudagraphs=True)`",
}


def activations_table(gpt: dict, llama: dict, fp8: dict | None) -> str:
    """Each saved-activation recipe against the same step without it, per model; the FP8 recipe
    against bf16 in one line."""
    meta, args = gpt["meta"], gpt["args"]
    tuned = f"`{args['inductor']}`" if args.get("inductor") else "inductor's defaults (no tuning flags)"
    out = [
        f"Saved activations, {meta['machine']}, {meta['date'][:10]}, {tuned}, bf16 autocast, "
        f"batch {args['batch']} x seq {args['seq']}; median of {args['rounds']} interleaved rounds "
        "[min-max], each ratio against the same model run the same way without compression (eager, "
        "compiled, or compiled with CUDA graphs). GPU = the step's kernel time.",
        "",
        "| model | recipe | activation memory | wall time | GPU time |",
        "|---|---|---|---|---|",
    ]
    for data in (gpt, llama):
        a = data["args"]
        name = f"{'GPT' if a['arch'] == 'gpt' else 'Llama'}, {a['layers']} x {a['dim']}"
        rows = {r["variant"]: r for r in data["rows"]}
        for variant, label in ACTIVATION_ROWS.items():
            if (r := rows.get(variant)) is None:
                continue
            wall, gpu = (fmt_spread(r[k], ".3f", "x") for k in ("wall_vs_base", "kernel_vs_base"))
            out.append(f"| {name} | {label} | {r['activation_vs_base']:.3f}x | {wall} | {gpu} |")
    summary = (fp8 or {}).get("summary", {})
    if recipe := summary.get("coatstate_compiled_graphs"):
        m = fp8["model"]
        flagged = "--inductor" in fp8.get("command", "")
        how = "with `--inductor` options" if flagged else "at inductor's defaults"
        out += [
            "",
            f"The FP8 recipe (compiled `FP8Linear` + `CompiledActivations` + `CompressedAdamW`, the "
            f"parity harness's `full`) on a {m['params'] / 1e9:.2f}B Llama ({m['layers']} x {m['dim']}, "
            f"seq {m['seq']}, batch {fp8['batch']}), {fp8['device']}, {fp8['date']}, {fp8['rounds']} "
            f"rounds {how}: {_fp8_figure(recipe)}.",
        ]
        others = [
            (
                "without saved-activation compression (compiled `FP8Linear` + `CompressedAdamW`)",
                "coatstate_compiled",
            ),
            ("with `CompiledActivations(cudagraphs=True)`", "coatstate_compiled_graphs_cg"),
            (
                "with `compress_activations()` around the compiled blocks instead, which cannot see op "
                "kinds there and packs every 16-bit saved tensor in FP8 groups, attention's q and k "
                "included (kept by default for accuracy)",
                "coatstate_compiled_ca",
            ),
        ]
        out += [f"- {label}: {_fp8_figure(summary[key])}." for label, key in others if key in summary]
    return "\n".join(out)


def _fp8_figure(method: dict) -> str:
    s = method["speedup_vs_bf16_spread"]
    return (
        f"**{s['median']:.2f}x** [{s['min']:.2f}-{s['max']:.2f}] bf16's tokens/s at "
        f"**{method['memory_reduction_vs_bf16']:.2f}x** less peak memory"
    )


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def tables() -> dict[str, str]:
    """{marker name: markdown} for every table whose results exist."""
    out = {}
    if parity := _load("parity_gpu"):
        out["accuracy"] = accuracy_table(parity)
        out["accuracy-summary"] = accuracy_summary(parity)
    parts = [_load(n) for n in ("whole_state_step", "optimizer_step", "activation_memory", "checkpoint_io")]
    if all(parts):
        out["headline"] = headline_table(*parts)
    if (gpt := _load("activation_memory")) and (llama := _load("activation_memory_llama")):
        out["activations"] = activations_table(gpt, llama, _load("fp8_linear_train_rounds"))
    return out


DOCS_WITH_TABLES = ("README.md", "docs/accuracy.md", "docs/performance.md")
"""The hand-written pages that hold generated tables between markers."""


def marked_blocks(text: str) -> dict[str, str]:
    """{name: the text between <!-- table:NAME --> and <!-- /table:NAME -->} of a page."""
    return dict(re.findall(r"<!-- table:([\w-]+) -->\n(.*?)<!-- /table:\1 -->", text, re.S))


def update_readme(pages: tuple[str, ...] = DOCS_WITH_TABLES) -> list[str]:
    """Rewrite each marked block of the README and the docs pages from the JSON; returns the
    names written (as page:name)."""
    written = []
    generated = tables()
    for page in pages:
        path = ROOT / page
        if not path.exists():
            continue
        text = path.read_text()
        for name, table in generated.items():
            pattern = re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.S)
            if pattern.search(text):
                text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
                written.append(f"{page}:{name}")
        path.write_text(text)
    return written
