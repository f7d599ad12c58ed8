"""python benchmarks/experiments/activation_policy_cosine.py        (CPU, about a minute)

What would holding attention's v and output in FP8 cost in gradient accuracy? The default
ActivationPolicy keeps them (attention_v_out="keep"); `attention_v_out="group"` is what the Llama
blocks would need for activation memory below 0.45x of uncompressed (docs/benchmarks.md); and
`norm="group"` (COAT's FP8 norm inputs instead of the default bfloat16), the other way there.
docs/FORMAT.md says why norm inputs stay bfloat16 although this short check passes: in 150 steps of
training the FP8 norm inputs ended 3.8% above uncompressed. Per
architecture (coatstate.models' GPT and eager Llama, 2 layers x 128, seq 64, batch 4, bf16
autocast) and seed: the worst cosine over all parameters between the gradients with and without
compression, for CompiledActivations (blocks compiled) against the same compiled blocks
uncompressed, and for compress_activations (eager) against eager uncompressed; and the saved
bytes' compression ratio. tests/activations/test_compiled_activations.py bounds the worst cosine at 0.999.
Writes benchmarks/experiments/results/activation_policy_cosine.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from coatstate import compress_activations  # noqa: E402
from coatstate.activations.compiled import CompiledActivations  # noqa: E402
from coatstate.models import GPT, Llama, ModelConfig  # noqa: E402

POLICIES = {
    "default": {},
    'attention_v_out="group"': {"attention_v_out": "group"},
    'norm="group"': {"norm": "group"},
}


def _grads(model, idx, tgt, ctx=None) -> dict:
    model.zero_grad(set_to_none=True)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        ctx or contextlib.nullcontext(),
    ):
        loss = model(idx, tgt)
    loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _compiled(model, options=None):
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.compile(options=options)
    return model


def _worst(ref: dict, got: dict) -> tuple[float, str]:
    cos = {n: F.cosine_similarity(ref[n].flatten(), got[n].flatten(), dim=0).item() for n in ref}
    name = min(cos, key=cos.get)
    return cos[name], name


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "activation_policy_cosine.json"))
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # (compiled float32 saves kept: expected)
    cfg = ModelConfig(vocab=128, layers=2, dim=128, heads=4, seq=64, loss_chunks=1, layout="eager")
    rows = []
    for arch, cls in (("gpt", GPT), ("llama", Llama)):
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = cls(cfg)
            idx, tgt = (torch.randint(0, cfg.vocab, (4, cfg.seq)) for _ in range(2))
            torch._dynamo.reset()
            compiled_ref, eager_ref = _grads(_compiled(model), idx, tgt), _grads(model, idx, tgt)
            for policy, overrides in POLICIES.items():
                torch._dynamo.reset()
                fp8 = CompiledActivations(min_numel=1024, **overrides)
                compiled_cos, compiled_worst = _worst(
                    compiled_ref, _grads(_compiled(model, fp8.options), idx, tgt)
                )
                ctx = compress_activations(min_numel=1024, **overrides)
                eager_cos, eager_worst = _worst(eager_ref, _grads(model, idx, tgt, ctx))
                rows.append(
                    dict(arch=arch, seed=seed, policy=policy, compiled_cosine=compiled_cos,
                         compiled_worst=compiled_worst, compiled_ratio=fp8.stats.ratio,
                         eager_cosine=eager_cos, eager_worst=eager_worst, eager_ratio=ctx.stats.ratio)
                )  # fmt: skip
                r = rows[-1]
                print(
                    f"{arch:5s} seed {seed} {policy:26s} compiled {r['compiled_cosine']:.6f} "
                    f"({r['compiled_ratio']:.2f}x smaller)  eager {r['eager_cosine']:.6f} "
                    f"({r['eager_ratio']:.2f}x)  worst: {r['compiled_worst']}",
                    flush=True,
                )
    result = dict(
        command="python benchmarks/experiments/activation_policy_cosine.py " + " ".join(argv or sys.argv[1:]),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()} CPU ({os.cpu_count()} cores), {platform.system()}",
        model=dict(layers=cfg.layers, dim=cfg.dim, heads=cfg.heads, seq=cfg.seq, batch=4),
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
