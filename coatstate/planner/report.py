"""What `coatstate plan` prints: a verdict line first, a table under 100 columns with short row
labels and a legend, advice when nothing fits, and a warning for a thin margin.

The verdict answers the question a team asks before adopting FP8 states ("how many GPUs do we
save?"): the fewest GPUs torch AdamW needs against the fewest any coatstate row needs. The
numbers come from coatstate.planner.memory.Plan; this module only words them.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coatstate.planner.memory import Plan, Row, Variant

GB = 1e9
WIDTH = 100
"""No line of the plan is wider (a terminal, a pasted issue)."""
MARGIN = 0.05
"""Below this share of GPU memory free, the CUDA context and allocator fragmentation (neither
counted by the plan) can push a job that "fits" out of memory."""
NONE = "-"
"""The one notation for "does not fit", in every column."""

PARTS = {  # a short label's parts, in order, with what each stands for in the legend
    "AdamW": "torch AdamW ({dtype} params; an fp32 master copy with bf16)",
    "C": "CompressedAdamW (FP8 moments; a 24-bit master correction with bf16)",
    "+A": "compress_activations (saved activations in FP8)",
    "+R": "gradient release (each gradient freed once its parameter steps)",
    "+4b": "4-bit moments (e2m1 / ue3m1_sqrt)",
    "+F8": "FP8 linear layers (convert_to_fp8). With +A, acts is larger than C+A's: each FP8 linear "
    "layer keeps its own FP8 copy of its input, where compress_activations alone shares one copy "
    "between the ops that save a tensor and recomputes the activation function's output.",
    "+CA": "CompiledActivations (each block torch.compile'd; inductor's partitioner picks what is "
    "saved, held in FP8 where the policy says, the rest recomputed in backward)",
}


def label_parts(v: Variant) -> list[str]:
    """The parts of a variant's short label, e.g. ['C', '+A', '+R'] for CompressedAdamW +
    compress_activations + gradient release."""
    parts = ["AdamW" if v.optimizer == "adamw" else "C"]
    if v.activations in ("compressed", "fp8"):
        parts.append("+A")
    if v.gradient_release:
        parts.append("+R")
    if v.moments == "4bit":
        parts.append("+4b")
    if v.activations in ("fp8", "compiled"):
        parts.append("+F8")
    if v.activations == "compiled":
        parts.append("+CA")
    if v.master_bits not in ("auto", 24):
        parts.append(f"+m{v.master_bits}")
    return parts


def labels(variants: list[Variant]) -> list[str]:
    """One short label per variant, unique (a repeated one gets its row number)."""
    out = ["".join(label_parts(v)) for v in variants]
    return [f"{lab}#{i + 1}" if out.count(lab) > 1 else lab for i, lab in enumerate(out)]


def _free(plan: Plan, row: Row) -> float:
    return 1 - row.bytes["peak"] / plan.setup["gpu_memory"]


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")


def best_coatstate(plan: Plan) -> Row | None:
    """The coatstate row a user would pick: fewest GPUs, then a margin of at least MARGIN, then the
    simplest (the first listed)."""
    rows = [r for r in plan.rows if r.variant.optimizer == "compressed" and r.min_gpus is not None]
    if not rows:
        return None

    def key(r: Row) -> tuple:
        thin = r.min_gpus == plan.setup["gpus"] and r.fits and _free(plan, r) < MARGIN
        return r.min_gpus, thin, plan.rows.index(r)

    return min(rows, key=key)


def verdict(plan: Plan) -> str:
    """One sentence: what torch AdamW needs, what coatstate needs, and what that saves."""
    s = plan.setup
    job = (
        f"{plan.model}, seq {s['seq']}, micro-batch {s['batch']}, {s['gpu_memory'] / GB:.4g} GB GPUs"
    )
    if not any(r.fits for r in plan.rows):
        return f"{job}: nothing fits micro-batch {s['batch']} on {_gpus(s['gpus'])} (advice below)."
    base = next((r for r in plan.rows if r.variant.optimizer == "adamw"), None)
    best = best_coatstate(plan)
    if best is None:
        return f"{job}: no coatstate row fits on any number of GPUs up to 4,096."
    name = f"{best.variant.name}: {best.bytes['peak'] / GB:.1f} GB"
    if base is None:
        return f"{job}: coatstate fits on {_gpus(best.min_gpus)} ({name})."
    if base.min_gpus is None:
        adamw = "torch AdamW does not fit on up to 4,096 GPUs"
    else:
        adamw = f"{base.variant.name} needs {_gpus(base.min_gpus)}"
    text = f"{job}: {adamw}; coatstate fits on {_gpus(best.min_gpus)} ({name})"
    if base.min_gpus is not None and best.min_gpus < base.min_gpus:
        text += f", saving {base.min_gpus - best.min_gpus} of {base.min_gpus} GPUs"
    elif base.min_gpus == best.min_gpus:
        more = best.max_batch - base.max_batch
        less = (base.bytes["peak"] - best.bytes["peak"]) / GB
        text += f", {less:.1f} GB less per GPU" + (f" and {more} more micro-batch" if more > 0 else "")
    return text + "."


def advice(plan: Plan) -> list[str]:
    """When nothing fits on the planned GPUs: the largest micro-batch that does, or activation
    checkpointing and sharding when not even one sequence fits."""
    if any(r.fits for r in plan.rows):
        return []
    s, names = plan.setup, dict(zip(map(id, plan.rows), labels(plan.variants), strict=True))
    best = max(plan.rows, key=lambda r: (r.max_batch, -plan.rows.index(r)))
    if best.max_batch > 0:
        who = ", ".join(names[id(r)] for r in plan.rows if r.max_batch == best.max_batch)
        return [
            f"advice: lower --batch to {best.max_batch}, the largest micro-batch that fits ({who}; "
            f"accumulate gradients to keep the global batch), or keep micro-batch {s['batch']} with "
            "activation checkpointing (torch.utils.checkpoint; the plan does not model it)."
        ]
    fewest = min((r.min_gpus for r in plan.rows if r.min_gpus is not None), default=None)
    if fewest is not None:
        how = f"shard over {fewest} GPUs (--gpus {fewest} --sharding fsdp2), "
    else:
        acts = min(r.bytes["activations"] for r in plan.rows) / GB
        how = f"(saved activations alone take {acts:.1f} GB per GPU, and FSDP2 does not shard them) "
    return [
        f"advice: not even micro-batch 1 fits: {how}use activation checkpointing "
        "(torch.utils.checkpoint; the plan does not model it) or a shorter --seq."
    ]


def margin_warnings(plan: Plan) -> list[str]:
    """A warning naming each row that fits with less than MARGIN of the GPU free."""
    names = labels(plan.variants)
    thin = [
        f"{names[i]} ({100 * _free(plan, r):.1f}%)"
        for i, r in enumerate(plan.rows)
        if r.fits and _free(plan, r) < MARGIN
    ]
    if not thin:
        return []
    return [
        f"warning: under {100 * MARGIN:g}% of the GPU left free by {', '.join(thin)}: the CUDA context "
        "and allocator fragmentation (not counted) may not fit; leave a margin."
    ]


COLUMNS = (  # (header, Row.bytes key)
    ("params", "params"),
    ("grads", "grads"),
    ("master", "master"),
    ("optim", "optimizer"),
    ("acts", "activations"),
    ("trans", "transient"),
    ("peak", "peak"),
)


def table(plan: Plan) -> str:
    """The verdict, the job, the table, its legend, then any advice, warning and notes."""
    names = labels(plan.variants)
    width = max(len("GB/GPU"), *map(len, names)) + 1
    head = f"{'GB/GPU':<{width}}" + "".join(f"{h:>8}" for h, _ in COLUMNS)
    head += f"{'free':>7}{'min GPUs':>10}{'max batch':>11}"
    out = [*_wrap("Verdict: " + verdict(plan)), "", *_wrap(plan.describe()), "", head]
    for name, r in zip(names, plan.rows, strict=True):
        cells = "".join(f"{r.bytes[k] / GB:8.2f}" for _, k in COLUMNS)
        free = f"{100 * _free(plan, r):.0f}%" + ("!" if _free(plan, r) < MARGIN else "") if r.fits else NONE
        gpus = NONE if r.min_gpus is None else str(r.min_gpus)
        batch = str(r.max_batch) if r.max_batch else NONE
        out.append(f"{name:<{width}}{cells}{free:>7}{gpus:>10}{batch:>11}")
    out += [""] + legend(plan)
    if any(v.optimizer == "compressed" for v in plan.variants) and plan.setup["gpus"] == 1:
        from coatstate.planner.offload import offload_row  # (it imports memory, which imports this)

        out += _wrap(offload_row(plan).line())
    out += [line for text in advice(plan) + margin_warnings(plan) for line in _wrap(text)]
    out += [line for n in plan.notes for line in _wrap(f"note: {n}")]
    return "\n".join(out)


def legend(plan: Plan) -> list[str]:
    """What each label part and column means, and where the activations come from."""
    dtype = plan.setup["param_dtype"]
    used = {p for v in plan.variants for p in label_parts(v)}
    lines = [f"{p:<6}{text.format(dtype=dtype)}" for p, text in PARTS.items() if p in used]
    lines += [f"{p:<6}master_bits={p[2:]}" for p in sorted(used - set(PARTS))]
    points = ", ".join(map(str, next(iter(plan.activations.values())).trace_points))
    text = [
        f"Columns: GB (1e9 bytes) per GPU; optim = optimizer states, acts = saved activations, trans "
        f"= the step's transient memory; peak = params + master + optim + the larger of grads (end "
        f"of backward) and acts + trans + one gradient (backward's peak): gradients and saved "
        f"activations do not coexist; free = share of {s_mem(plan)} left at the peak (! under "
        f"{100 * MARGIN:g}%); min GPUs = fewest GPUs that hold the job at this micro-batch (FSDP2 "
        f"when more than one); max batch = largest micro-batch on {_gpus(plan.setup['gpus'])}; "
        f"{NONE} = does not fit. Activations from a CPU trace at (batch, seq) = {points}, scaled "
        "(docs/planner.md).",
    ]
    return [line for part in lines for line in _wrap(part, indent=" " * 6)] + [
        line for t in text for line in _wrap(t)
    ]


def s_mem(plan: Plan) -> str:
    return f"{plan.setup['gpu_memory'] / GB:.4g} GB"


def first_paragraph(message: str) -> str:
    """An error message's first paragraph on one line: dynamo follows its error with advice ("Set
    TORCHDYNAMO_VERBOSE=1 ...") and the user code's frames, which a plan's note leaves out."""
    return " ".join(message.strip().split("\n\n")[0].split())


def _wrap(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]


def summary(plan: Plan) -> dict[str, Any]:
    """The verdict, advice, warnings and the offload row for --json."""
    from coatstate.planner.offload import offload_summary
    return {
        "verdict": verdict(plan),
        "labels": labels(plan.variants),
        "advice": advice(plan),
        "warnings": margin_warnings(plan),
        "offload": offload_summary(plan) if plan.setup["gpus"] == 1 else None,
    }
