"""python benchmarks/optimizers_cpu_train.py

CompressedSGD, CompressedLion and CompressedMuon (default formats) against their references
(torch.optim.SGD, the float32 Lion of tests/optim/test_sgd_lion_muon.py, torch.optim.Muon) on a
tiny byte-level GPT (coatstate.models) trained on the standard library's sources (corpus_python.py).
Muon steps the blocks' 2-D weights, torch AdamW the rest in both runs. --seeds seeds a variant,
each seed the same init and batches on both sides. Reports state bytes per parameter, the mean final
validation loss, the reference's seed spread and the paired difference with its 95% interval.

    python benchmarks/optimizers_cpu_train.py --steps 5 --seeds 1 --out /tmp/o.json   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import result_meta
from corpus_python import joined_files, load_corpus, validation_tokens, window_batch
from report_common import interval, optimizers_cpu_train_table

import coatstate
from coatstate.models import GPT, ModelConfig
from coatstate.optim import optimizer_state_bytes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the reference Lion lives with its tests
from tests.optim.test_sgd_lion_muon import Lion  # noqa: E402


def _hidden(model: GPT) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]


def _optimizers(kind: str, compressed: bool, model: GPT) -> tuple[list, torch.optim.Optimizer]:
    """(every optimizer of the run, the one being compared)."""
    params = list(model.parameters())
    if kind == "sgd":
        kw = dict(lr=0.1, momentum=0.9, nesterov=True)
        opt = (
            coatstate.CompressedSGD(params, **kw)
            if compressed
            else torch.optim.SGD(params, foreach=False, **kw)
        )
        return [opt], opt
    if kind == "lion":
        kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        opt = coatstate.CompressedLion(params, **kw) if compressed else Lion(params, **kw)
        return [opt], opt
    hidden = _hidden(model)
    rest = [p for p in params if all(p is not q for q in hidden)]
    kw = dict(lr=0.02, weight_decay=0.01)
    muon = coatstate.CompressedMuon(hidden, **kw) if compressed else torch.optim.Muon(hidden, **kw)
    return [muon, torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)], muon


@torch.no_grad()
def _validation_loss(model: GPT, val: torch.Tensor, seq: int) -> float:
    rows = val[: (len(val) - 1) // seq * seq + 1]
    x, y = rows[:-1].view(-1, seq).long(), rows[1:].view(-1, seq).long()
    return sum(
        model(x[i : i + 32], y[i : i + 32]).item() * len(x[i : i + 32]) for i in range(0, len(x), 32)
    ) / len(x)


def run(kind: str, compressed: bool, seed: int, args, train: torch.Tensor, val: torch.Tensor) -> dict:
    torch.manual_seed(seed)
    model = GPT(ModelConfig.byte_level(args.layers, args.dim, args.seq))
    opts, compared = _optimizers(kind, compressed, model)
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = window_batch(train, seed, step, args.batch, args.seq)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    seconds = time.perf_counter() - t0
    numel = sum(p.numel() for g in compared.param_groups for p in g["params"])
    return {
        "kind": kind,
        "compressed": compressed,
        "seed": seed,
        "final_train_loss": loss.item(),
        "val_loss": _validation_loss(model, val, args.seq),
        "state_bytes_per_param": optimizer_state_bytes(compared) / numel,
        "params_compared": numel,
        "seconds": seconds,
    }


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in runs):
        ref = sorted((r for r in runs if r["kind"] == kind and not r["compressed"]), key=lambda r: r["seed"])
        ours = sorted((r for r in runs if r["kind"] == kind and r["compressed"]), key=lambda r: r["seed"])
        diffs = [b["val_loss"] - a["val_loss"] for a, b in zip(ref, ours, strict=True)]
        spread = max(r["val_loss"] for r in ref) - min(r["val_loss"] for r in ref)
        mean_diff = statistics.mean(diffs)
        rows.append(
            {
                "optimizer": kind,
                "seeds": len(diffs),
                "ref_bytes_per_param": ref[0]["state_bytes_per_param"],
                "ours_bytes_per_param": ours[0]["state_bytes_per_param"],
                "ref_val_loss": statistics.mean(r["val_loss"] for r in ref),
                "ours_val_loss": statistics.mean(r["val_loss"] for r in ours),
                "ref_seed_spread": spread,
                "diff": mean_diff,
                "diff_ci95": list(interval(diffs) or (float("nan"),) * 2),  # 95% t interval of the mean
                "within_spread": abs(mean_diff) <= spread,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", default="sgd,lion,muon")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--val-tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default="/tmp/coatstate_corpus")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "optimizers_cpu_train.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_corpus("stdlib", args.cache_dir)
    train = joined_files(corpus, validation=False)
    val = validation_tokens(corpus, args.val_tokens, args.seq)
    runs = []
    for kind in args.optimizers.split(","):
        for seed in range(args.seeds):
            for compressed in (False, True):
                runs.append(run(kind, compressed, seed, args, train, val))
                r = runs[-1]
                print(f"{kind} {'ours' if compressed else 'ref '} seed {seed}: val {r['val_loss']:.4f} "
                      f"({r['seconds']:.1f} s)", file=sys.stderr)  # fmt: skip
    rows = summarize(runs)
    print("\n".join(optimizers_cpu_train_table(rows)))
    meta = {**result_meta(args), "threads": torch.get_num_threads()}
    out = {"meta": meta, "corpus": corpus["stats"], "summary": rows, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
