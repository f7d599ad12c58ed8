"""docs/benchmarks.md's sections on optimizer-state accuracy: the GPU training parity (seed table
and what FP8 loses of AdamW's real moments) and the 4-bit candidates measured on real moments."""

from __future__ import annotations

import statistics
from pathlib import Path

from parity_stats import NOISIER, fmt_ci, fmt_pct, pooled_noise, reconstruction_rows, summaries
from report_common import _f, provenance


def section_parity_gpu(data: dict, path: Path) -> str:
    """Seed table (mean ± std, vs AdamW's mean, paired 95% interval) and, from AdamW's final
    moments, what each FP8 format loses; a result of the old contiguous batches says it is one."""
    meta, cfg = data.get("meta", {}), data["config"]
    sampling = cfg.get("sampling", "one contiguous stream of whole files (1-2 files per batch)")
    final = cfg.get("final_val", f"the first {data['validation']['tokens']:,} held-out tokens")
    positions = {"rope": "rotary"}.get(cfg.get("positions"), "learned")
    out = [
        f"## Training parity on a GPU (`{path.name}`)",
        f"{meta.get('machine', '')}, {meta.get('date', '')}: a {data['model']['params'] / 1e6:.1f}M-param "
        f"byte-level GPT with {positions} positions, {cfg['tokens'] / 1e6:.0f}M tokens per run; "
        f"batches of {sampling}; peak lr "
        f"{cfg['lr']:g}, cosine to {cfg['min_lr_frac']:g} of it; final validation loss on {final}. "
        "Source: `python benchmarks/parity_gpu.py` (curves: `docs/img/parity_gpu.png`)."
        + (f" {meta['note'][0].upper()}{meta['note'][1:]}." if meta.get("note") else ""),
        "",
        "| variant | seeds | val loss mean | std | vs AdamW's mean [95% Welch CI] | paired % [95% CI] | "
        "tokens/s | peak GiB | optimizer MB | max grad norm after 1/5 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    variants = list(dict.fromkeys(x["variant"] for x in data["runs"].values()))
    for r in summaries(data, variants):
        std = "" if r["std"] is None else f"{r['std']:.4f}"
        rate = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else ""
        out.append(
            f"| {r['variant']} | {','.join(map(str, r['seeds']))} | {r['mean']:.4f} | {std} | "
            f"{fmt_pct(r['vs_adamw_mean_pct'])} {fmt_ci(r['welch_ci_pct'])} | "
            f"{fmt_pct(r['paired_mean_pct'])} {fmt_ci(r['paired_ci_pct'])} | {rate} | {r['peak_gib']:.1f} | "
            f"{r['opt_state_mb']:.0f} | {_f(r['grad_norm_late_max'], '.2f')} |"
        )
    if noise := pooled_noise(data, variants):
        resolve = f"±{noise['resolvable_3_seeds_pct']:.2f}% (95%)"
        out += ["", f"One run's std about its variant's mean, pooled over {noise['runs']} runs "
                f"({noise['dof']} degrees of freedom): {noise['std_pct']:.2f}% of the loss; 3 seeds a side "
                f"resolve a difference of means of {resolve}."]  # fmt: skip
        if noise["excluded"]:
            out[-1] += (f" Left out of the pool as noisier than AdamW (seed std over {NOISIER:g}x "
                        f"AdamW's): {', '.join(noise['excluded'])}.")  # fmt: skip
    if shared := sorted(k for k, r in data["runs"].items() if r.get("gpu_shared_by", 1) > 1):
        out += ["", f"{', '.join(shared)} shared one GPU with other runs: their losses count, their "
                "tokens/s does not (left out of the rate column)."]  # fmt: skip
    heads, recon = reconstruction_rows(data)
    if recon:
        out += ["", "E4M3 groups of 128 on AdamW's final moments, relative squared error; update = "
                "m / (sqrt(v) + eps) with m / v in the formats named:", "",
                "| seed | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]  # fmt: skip
        out += [f"| {seed} | " + " | ".join(f"{x:.2e}" for x in vals) + " |" for seed, vals in recon]
    return "\n".join(out + [""])


def section_fp4_reconstruction(data: dict, path: Path) -> str:
    """Mean over seeds of each candidate's relative squared error, per moment and per update pair."""
    date, machine = provenance(data, path)
    runs, nbytes = data["runs"], data["bytes_per_element"]
    mean = lambda xs: f"{statistics.fmean(xs):.2e} [{min(xs):.1e}-{max(xs):.1e}]"
    out = [
        "## 4-bit moment formats on real Adam moments",
        f"{machine}, {date}: torch AdamW trains `examples/train_gpt.py`'s GPT on CPU at {len(runs)} seeds; "
        "its final moments are encoded with each candidate (formats/fp4.py) and decoded. Relative "
        "squared error, mean over seeds [min-max]. Source: `python benchmarks/fp4_reconstruction.py`.",
        "",
        "| moment | format | bytes/element | error |",
        "|---|---|---|---|",
    ]
    for moment in ("m", "v"):
        for name in runs[0]["moments"][moment]:
            errs = [r["moments"][moment][name] for r in runs]
            out.append(f"| {moment} | {name} | {nbytes[name]:.3f} | {mean(errs)} |")
    out += ["", "| update m / (sqrt(v) + eps): m format | v format | error |", "|---|---|---|"]
    for pair in runs[0]["update"]:
        errs = [r["update"][pair]["rel_sq_err"] for r in runs]
        out.append("| " + " | ".join(pair.split("/")) + f" | {mean(errs)} |")
    return "\n".join(out + [""])


def section_fp4_shadow(data: dict, path: Path) -> str:
    """Per candidate and report step, the mean over seeds of its shadow update against AdamW's."""
    date, machine = provenance(data, path)
    runs = data["runs"]
    args = data["meta"].get("args", {})
    out = [
        "## 4-bit moments re-encoded every step (shadow states)",
        f"{machine}, {date}: torch AdamW (betas {args.get('betas', '?')}, lr {args.get('lr', '?')}) trains "
        f"`examples/train_gpt.py`'s GPT ({args.get('layers', '?')} x {args.get('dim', '?')}) on CPU at "
        f"{len(runs)} seed(s); beside it each candidate keeps its own moments, fed the same gradients and "
        "stored in its formats after every step. along = <u', u> / <u, u> of the candidate's update u' "
        "against AdamW's u (above 1: larger steps in effect); cos = their cosine; v bias = exp(mean "
        "log(v' / v)). Mean over seeds. Source: `python benchmarks/fp4_shadow.py`.",
        "",
        "| m / v formats | step | along | cos | v bias |",
        "|---|---|---|---|---|",
    ]
    names = [k for k in runs[0]["rows"][0] if k not in ("step", "loss")]
    for name in names:
        for i, row in enumerate(runs[0]["rows"]):
            vals = [statistics.fmean(r["rows"][i][name][k] for r in runs) for k in ("along", "cos", "v_bias")]
            out.append(f"| {name} | {row['step']} | " + " | ".join(f"{x:.3f}" for x in vals) + " |")
    return "\n".join(out + [""])


def section_parity_step_profile(data: dict, path: Path) -> str:
    """parity_gpu's training step per position scheme: median ms [min-max] over the rounds, the
    compute floor, and each scheme's top kernels (the rotation's own, where it is slow)."""
    date, machine = provenance(data, path)
    meta, rows = data["meta"], data["rows"]
    args = meta.get("args", {})
    out = [
        "## Parity harness: the training step per position scheme"
        + ("" if path.stem == "parity_step_profile" else f" ({path.stem})"),
        f"{machine}, {date}: parity_gpu.py's GPT ({args.get('layers', '?')} x {args.get('dim', '?')}, "
        f"batch {args.get('batch', '?')} x {args.get('seq', '?')}), every block compiled, bf16 autocast, "
        f"torch's fused AdamW; {args.get('rounds', '?')} interleaved rounds of {args.get('steps', '?')} "
        "steps. Floor: 6 x params x tokens + causal attention at the bf16 peak. Same function as rope, "
        f"max |difference|: rope_bshd {meta.get('rope_bshd_max_abs_diff', '-')}, rope_table "
        f"{meta.get('rope_table_max_abs_diff', '-')}. Source: `python benchmarks/parity_step_profile.py`."
        + (f" {meta['note'][0].upper()}{meta['note'][1:]}." if meta.get("note") else ""),
        "",
        "| variant | params | step ms [min-max] | tokens/s | floor ms | top kernels (ms/step) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["spread_ms"]
        top = "; ".join(f"{k['name'][:48]} {k['ms_per_step']:.1f}" for k in r["kernels"]["top"][:3])
        out.append(
            f"| {r['variant']} | {r['params']:,} | {r['step_ms']:.2f} [{lo:.2f}-{hi:.2f}] | "
            f"{r['tokens_per_s']:,.0f} | {r['compute_floor_ms']:.2f} | {top} |"
        )
    return "\n".join(out + [""])


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
