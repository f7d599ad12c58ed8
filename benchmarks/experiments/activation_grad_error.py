"""python benchmarks/experiments/activation_grad_error.py      (CPU, 2 cores: about 15 minutes)
python benchmarks/experiments/activation_grad_error.py --train-steps 600 \
    --out benchmarks/experiments/results/activation_grad_error_600.json
    (about 15 minutes more: a later state)

Where do FP8 saved activations cost gradient accuracy? parity_gpu.py's GPT (coatstate.models; by default
4 layers x 256, 4 heads, seq 256, batch 8) is trained --train-steps with torch AdamW, bf16 autocast,
on random windows of the stdlib's .py files; then, weights fixed, the parameter gradients of
--batches held-out batches are compared per variant with a reference's on the same batch:
  ref / noise_eager / noise_fp32   compiled blocks, nothing packed / the same math eager (the floor)
                 / no autocast (what bf16 itself changes: the scale of ordinary numerical noise)
  ca, ca_<field> CompiledActivations() with the default policy (parity_gpu's compressed_ca) / with
                 one ActivationPolicy field changed, to attribute the error to a saved-tensor kind
  ca_qk, ca_vout VariantBlock "split_v" (v copied out of the qkv buffer): q, k or v and out packed
  fq, ca_fq      VariantBlock "fq": attention's forward reads FP8-decoded q, k, v, without / with CA
  fp8linear, full, full_vs_ref   convert_to_fp8 (head kept); + CA against fp8linear / against ref
  eager_ca       compress_activations() on eager blocks, against noise_eager
Per parameter kind (head = ln_f + head, which CA cannot change), over the kind's concatenated
gradients: cos (mean cosine), rel (mean ||e|| / ||g_ref||, e = g - g_ref), bias (||mean_b e|| /
mean_b ||g_ref||), coh (||mean_b e|| / rms_b ||e||: 1/sqrt(batches) for errors independent between
batches, 1 for a systematic one), scale (mean <e, g_ref> / ||g_ref||^2: a gradient systematically
larger or smaller). attention_check: per layer, on real q, k, v and dO, the row sums of the softmax
that backward recomputes from FP8 q, k with the exact forward's logsumexp, and the errors of dq, dk,
dv. Writes benchmarks/experiments/results/activation_grad_error.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from coatstate.formats import activation as codec  # noqa: E402
from common import result_meta  # noqa: E402
from corpus_python import joined_files, load_corpus, window_batch  # noqa: E402

import coatstate  # noqa: E402
from coatstate.models import GPT, GPTBlock, ModelConfig  # noqa: E402

KINDS = {"qkv": ".qkv.", "attn_out": ".attn.proj.", "fc1": ".mlp.0.", "fc2": ".mlp.2.", "ln": ".ln"}
KINDS |= {"embedding": "wte wpe", "head": "ln_f .head."}
V = dict  # a variant: ca (policy overrides or None), eager, autocast, fp8, hooks, block, ref (its reference)
VARIANTS = {
    "noise_eager": V(eager=True),
    "noise_fp32": V(autocast=False),
    "ca": V(ca={}),
    "ca_norm_keep": V(ca=dict(norm="keep")),  # the block input (fp32 residual) held as it is
    "ca_norm_group": V(ca=dict(norm="group")),
    "ca_attention_keep": V(ca=dict(attention="keep")),  # q, k and v (one buffer) kept
    "ca_other_keep": V(ca=dict(other="keep")),  # the GELU input (labelled 'other': see the report)
    "ca_activation_keep": V(ca=dict(activation="keep")),
    "ca_v_out_group": V(ca=dict(attention_v_out="group")),  # attention's output packed too
    "ca_qk": V(ca={}, block="split_v", ref="ref_split"),  # q, k packed, v kept
    "ca_vout": V(ca=dict(attention="keep", attention_v_out="group"), block="split_v", ref="ref_split"),
    "fq": V(block="fq"),  # FP8 q, k, v in attention's forward, nothing packed: the forward's share
    "ca_fq": V(ca={}, block="fq"),  # + CA (default policy): the proposed fix, end to end
    "ca_attention_other_keep": V(ca=dict(attention="keep", other="keep")),
    "fp8linear": V(fp8=True),
    "full": V(ca={}, fp8=True, ref="fp8linear"),
    "full_vs_ref": V(ca={}, fp8=True),
    "eager_ca": V(eager=True, hooks=True, ref="noise_eager"),
}
REFS = {"ref": V(), "ref_split": V(block="split_v")}


class FakeQuant(torch.autograd.Function):
    """x through CompiledActivations' per-group FP8 codec in forward; gradient passed straight."""

    @staticmethod
    def forward(ctx, x):
        codes, scales = codec.pack_groups(x.reshape(-1, x.shape[-1]), 16, "e4m3")
        return codec.unpack_groups(codes, scales, 16, x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        return g


class VariantBlock(GPTBlock):
    """The GPT's block, with `mode` "split_v": v copied out of the qkv buffer (same values), so
    that q/k and v are two storages that CompiledActivations packs by their own kinds; "fq": the
    attention reads q, k, v decoded from FP8 in forward too (the fix: lse and output then belong
    to the values backward reads; CA's packing of them is then lossless)."""

    mode = "split_v"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.attn.qkv(self.ln1(x))
        qkv = FakeQuant.apply(qkv) if self.mode == "fq" else qkv
        q, k, v = (t.view(b, s, self.attn.heads, -1).transpose(1, 2) for t in qkv.split(d, 2))
        v = v.clone(memory_format=torch.contiguous_format) if self.mode == "split_v" else v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=150, help="AdamW steps before the comparison")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batches", type=int, default=6, help="held-out batches compared")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-corpus-mb", type=float, default=16)
    ap.add_argument("--cache-dir", default="/tmp/coatstate_corpus")
    ap.add_argument("--state", default="", help="cache the trained weights here (reused if present)")
    ap.add_argument("--out", default=str(HERE / "results" / "activation_grad_error.json"))
    return ap.parse_args(argv)


def new_model(args, mode=None) -> GPT:
    torch.manual_seed(args.seed)
    cfg = ModelConfig(vocab=256, layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq)
    model = GPT(dataclasses.replace(cfg, tied=False, gpt2_init=True))  # (parity_gpu.py's)
    for i, blk in enumerate(model.blocks if mode else []):
        model.blocks[i] = VariantBlock(model.cfg)
        model.blocks[i].mode = mode
        model.blocks[i].load_state_dict(blk.state_dict())
    return model


def train(args, data: torch.Tensor) -> tuple[dict, list]:
    """AdamW(0.9, 0.95), wd 0.1, clip 1, warmup 10% then cosine; compiled blocks, bf16 autocast."""
    model = new_model(args)
    for blk in model.blocks:
        blk.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm, losses = max(1, args.train_steps // 10), []
    for s in range(args.train_steps):
        p = (s - warm) / max(1, args.train_steps - warm)
        for g in opt.param_groups:
            g["lr"] = args.lr * ((s + 1) / warm if s < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * p)))
        rows = window_batch(data, args.seed, s, args.batch, args.seq)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if s % 25 == 0 or s == args.train_steps - 1:
            print(f"train step {s}: loss {losses[-1]:.4f}", flush=True)
    torch._dynamo.reset()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def gradients(spec: dict, state: dict, args, batches) -> tuple[list[dict], dict]:
    """Per batch {param name: grad} under a variant, and what CompiledActivations reported."""
    torch._dynamo.reset()  # (a fresh compile per variant: dynamo's cache limit would fall back to eager)
    model = new_model(args, spec.get("block"))
    model.load_state_dict(state)
    if spec.get("fp8"):
        coatstate.convert_to_fp8(model, filter_fn=lambda m, name: name != "head")
    ca = coatstate.CompiledActivations(**spec["ca"]) if spec.get("ca") is not None else None
    if not spec.get("eager"):
        for blk in model.blocks:
            blk.compile(options=ca.options if ca else None)
    out, hooks = [], None
    for rows in batches:
        model.zero_grad(set_to_none=True)
        hooks = coatstate.compress_activations() if spec.get("hooks") else None
        with torch.autocast("cpu", torch.bfloat16, enabled=spec.get("autocast", True)):
            with hooks if hooks else contextlib.nullcontext():
                loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        out.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
    info = {}
    if ca is not None:
        st = ca.stats
        info = dict(graphs=ca.graphs, packed=st.packed, kept=st.kept, packed_by_kind=dict(st.packed_by_kind))
        info |= dict(saved_bytes=st.activation_bytes_original, held_bytes=st.activation_bytes_held)
        info["report"] = [f"{n} {list(s)} {d}: {w}" for n, s, d, w in ca.report if "kept: param" not in w]
    elif hooks is not None:
        info = dict(ratio=round(hooks.stats.ratio, 3), summary=hooks.stats.summary())
    return out, info


def kind_of(name: str) -> str:
    return next(k for k, keys in KINDS.items() if any(key in f".{name}" for key in keys.split()))


def compare(grads: list[dict], refs: list[dict]) -> dict:
    """Per kind (and per layer: 'layer<i>'): cos, rel, bias, coh, scale (the module docstring)."""
    groups: dict[str, list[str]] = {}
    for n in refs[0]:
        groups.setdefault(kind_of(n), []).append(n)
        if n.startswith("blocks."):
            groups.setdefault(f"layer{n.split('.')[1]}", []).append(n)
    out = {}
    for key, names in groups.items():
        g, r = (
            torch.stack([torch.cat([b[n].flatten() for n in names]) for b in x]).double()
            for x in (grads, refs)
        )
        e, rn = g - r, r.norm(dim=1)
        en, mean_e = e.norm(dim=1), e.mean(0).norm()
        cos = F.cosine_similarity(g, r, dim=1).mean()
        stats = dict(cos=cos, rel=(en / rn).mean(), bias=mean_e / rn.mean())
        stats |= dict(
            coh=mean_e / en.pow(2).mean().sqrt().clamp_min(1e-300), scale=((e * r).sum(1) / rn**2).mean()
        )
        out[key] = {k: float(v) for k, v in stats.items()}
    return out


def attention_backward(q, k, v, d_o, mask, lse=None, o=None) -> list[torch.Tensor]:
    """(dq, dk, dv) as a flash backward computes them from the saved q, k, v, o and logsumexp:
    P = exp(q k^T / sqrt(hd) - lse), D = rowsum(dO * o); lse and o from these q, k, v if None."""
    logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    lse = logits.logsumexp(-1, keepdim=True) if lse is None else lse
    p = (logits - lse).exp()
    o = p @ v if o is None else o
    ds = p * (d_o @ v.transpose(-1, -2) - (d_o * o).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return [ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_o]


def attention_check(state: dict, args, rows: torch.Tensor) -> list[dict]:
    """Per layer, on one batch's real q, k, v (the qkv buffer packed per group as CompiledActivations
    packs it) and real dO: the softmax row sums that P recomputed from FP8 q, k with the exact
    logsumexp has (minus 1), and the error of dq, dk, dv (rel; scale = <e, g> / ||g||^2) when
    backward reads FP8 q, k, v with the exact forward's lse and output (what CA does: "ca"), FP8 q,
    k only ("ca_qk"), or FP8 q, k, v with an lse and output recomputed from them ("consistent")."""
    model = new_model(args)
    model.load_state_dict(state)
    seen, hd = {}, args.dim // args.heads
    for i, blk in enumerate(model.blocks):
        blk.attn.qkv.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("qkv", i), o.detach()))
        blk.attn.proj.register_full_backward_hook(lambda m, gi, go, i=i: seen.__setitem__(("do", i), gi[0]))
    with torch.autocast("cpu", torch.bfloat16):
        model(rows[:, :-1], rows[:, 1:]).backward()
    out, mask = [], torch.ones(args.seq, args.seq, dtype=torch.bool).tril()
    for i in range(args.layers):
        qkv, b, s, d = seen["qkv", i], *seen["do", i].shape
        codes, scales = codec.pack_groups(qkv.reshape(-1, 3 * d), 16, "e4m3")
        deq = codec.unpack_groups(codes, scales, 16, qkv.dtype).reshape(b, s, 3 * d)
        heads = lambda t: t.float().view(b, s, args.heads, hd).transpose(1, 2)  # noqa: B023
        exact, fp8 = ([heads(t) for t in x.split(d, 2)] for x in (qkv, deq))
        d_o = heads(seen["do", i])
        logits = (exact[0] @ exact[1].transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, -math.inf)
        lse = logits.logsumexp(-1, keepdim=True)
        o = (logits - lse).exp() @ exact[2]
        ref = attention_backward(*exact, d_o, mask)
        cases = dict(ca=attention_backward(*fp8, d_o, mask, lse, o))
        cases["ca_qk"] = attention_backward(*fp8[:2], exact[2], d_o, mask, lse, o)
        cases["consistent"] = attention_backward(*fp8, d_o, mask)
        fp8_logits = (fp8[0] @ fp8[1].transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, -math.inf)
        rowsum = (fp8_logits - lse).exp().sum(-1) - 1
        rec = dict(rowsum_mean=float(rowsum.mean()), rowsum_abs=float(rowsum.abs().mean()))
        rec["max_logit"] = float(logits[..., mask].abs().max())
        for name, grads in cases.items():
            for g_name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
                e = (g - r).flatten().double()
                rec[f"{name}_{g_name}_rel"] = float(e.norm() / r.norm())
                rec[f"{name}_{g_name}_scale"] = float(e @ r.flatten().double() / r.norm() ** 2)
        out.append(rec)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.monotonic()
    corpus = load_corpus("stdlib", args.cache_dir, max_mb=args.max_corpus_mb)
    train_data, val = joined_files(corpus, validation=False), joined_files(corpus, validation=True)
    path = Path(args.state) if args.state else None
    key = [args.layers, args.dim, args.heads, args.seq, args.batch, args.train_steps, args.lr, args.seed]
    if path and path.exists():
        saved = torch.load(path, weights_only=True)
        if saved["args"] != key:
            raise SystemExit(f"{path} holds weights of another config")
        state, losses = saved["state"], saved["losses"]
    else:
        state, losses = train(args, train_data)
        if path:
            torch.save(dict(state=state, losses=losses, args=key), path)
    batches = [window_batch(val, 10_000 + args.seed, b, args.batch, args.seq) for b in range(args.batches)]
    names = args.variants.split(",")
    wanted = {VARIANTS[n].get("ref", "ref") for n in names} | {"ref"}
    specs = REFS | VARIANTS
    grads, info, results = {}, {}, {}
    for name in [n for n in specs if n in wanted] + [n for n in names if n not in wanted]:
        t = time.monotonic()
        grads[name], info[name] = gradients(specs[name], state, args, batches)
        if name in VARIANTS:
            ref = specs[name].get("ref", "ref")
            results[name] = dict(ref=ref, by_kind=compare(grads[name], grads[ref]), **info[name])
            print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    attn = attention_check(state, args, batches[0])
    print_table(results, attn)
    meta = result_meta(args) | dict(wall_s=round(time.monotonic() - t0))
    record = dict(meta=meta, config=vars(args), train_loss=losses, ref_info=info["ref"], variants=results)
    record["attention_check"] = attn
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} ({meta['wall_s']} s)")
    return record


def print_table(results: dict, attn: list[dict]) -> None:
    kinds = list(KINDS)
    print("\nper kind: rel = mean ||g - g_ref|| / ||g_ref||  (cos = 1 - mean cosine, bias, coh, scale)")
    print(f"{'variant':<20}{'ref':<12}" + "".join(f"{k:>10}" for k in kinds) + "   layer rel (0 ..)")
    for name, r in results.items():
        row = "".join(f"{r['by_kind'][k]['rel']:>10.2e}" for k in kinds)
        layers = " ".join(f"{v['rel']:.1e}" for k, v in r["by_kind"].items() if k.startswith("layer"))
        print(f"{name:<20}{r['ref']:<12}{row}   {layers}")
    for stat in ("cos", "bias", "coh", "scale"):
        print(f"\n{stat}" + ("  (1 - cos)" if stat == "cos" else ""))
        for name, r in results.items():
            vals = [r["by_kind"][k][stat] for k in kinds]
            vals = [1 - v for v in vals] if stat == "cos" else vals
            print(f"{name:<32}" + "".join(f"{v:>10.2e}" for v in vals))
    print("\nattention_check: rowsum(P) - 1 (mean, mean |.|), max |logit|; rel error of dq dk dv:")
    print("as CA does (exact lse, o) | FP8 q, k only | consistent (lse, o from the FP8 q, k, v)")
    for i, a in enumerate(attn):
        cases = ("ca", "ca_qk", "consistent")
        rels = " | ".join(" ".join(f"{a[f'{c}_{g}_rel']:.1e}" for g in ("dq", "dk", "dv")) for c in cases)
        print(f"layer {i}: {a['rowsum_mean']:+.1e} {a['rowsum_abs']:.1e} {a['max_logit']:5.1f}   {rels}")


if __name__ == "__main__":
    main()
