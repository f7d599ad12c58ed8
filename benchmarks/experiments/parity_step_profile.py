"""python benchmarks/experiments/parity_step_profile.py --rounds 5      (one GPU; --smoke: CPU, seconds)

Why is parity_gpu.py's rotary-position model slower? On the H200 a parity run took about 147 s
with rotary positions against 107 s with learned ones (400k against 579k tokens/s), for the same
shapes. This times the training step (forward, backward, torch's fused AdamW) of parity_gpu's
GPT, every block compiled as there, for each position scheme, interleaved over --rounds:
  learned     GPT-2's learned absolute positions (the old design)
  rope        the harness's rotation: q and k rotated after the (b, h, s, d) transpose
  rope_bshd   the same rotation applied before the transpose, so q, k and v reach SDPA as
              views of one layout (a candidate fix: the same function, another memory layout)
  rope_table  the same rotation with its cos and sin tables computed once per model, on the device,
              and passed to every block (the other candidate: inductor otherwise computes pow, cos
              and sin per element in the rotation's forward and backward kernels)
The table variant is a fix only if it is the same arithmetic: on CUDA the compiled block's outputs
and gradients are compared with rope's bit for bit (the eager path too, which validation uses).
Found on the H200 (results/parity_step_profile*.json): the rotation's own kernels take 18 ms of
rope's 81 ms step (attention's are the same as learned's); rope_bshd 80.5 ms; rope_table 65.2 ms
against rope's 81.0 and learned's 55.8 in one run, but not the same bits compiled (eager: equal).
So parity_gpu.py keeps its rotation, and the runs made with it stay one design.
Random tokens: timing does not depend on the data. Per variant, once, torch.profiler's top CUDA
kernels and the attention kernels SDPA chose, to say where the time goes. The compute floor is
6 x params x tokens + the causal attention's 6 x layers x batch x seq^2 x dim FLOPs at --peak-tflops.
Prints a table and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import result_meta  # noqa: E402

from coatstate.models import GPT, GPTBlock, ModelConfig  # noqa: E402

VARIANTS = ("learned", "rope", "rope_bshd", "rope_table")


def config(args, positions: str = "rope") -> ModelConfig:
    """parity_gpu.py's GPT."""
    cfg = ModelConfig(vocab=256, layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq)
    return ModelConfig(**{**cfg.__dict__, "positions": positions, "tied": False, "gpt2_init": True})


def rotate_bshd(x: torch.Tensor) -> torch.Tensor:
    """coatstate.models.rotate on (batch, seq, heads, head_dim), by the same expression."""
    s, half = x.shape[-3], x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(s, device=x.device, dtype=torch.float32).view(s, 1, 1) * freq
    cos, sin, xf = angle.cos(), angle.sin(), x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1).to(x.dtype)


class BlockBSHD(GPTBlock):
    """The GPT's block with q and k rotated in (batch, seq, heads, head_dim), before the transpose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.attn.heads, -1) for t in self.attn.qkv(self.ln1(x)).split(d, 2))
        q, k = rotate_bshd(q), rotate_bshd(k)  # contiguous (b, s, h, hd), like v's rows
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def rope_tables(seq: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of coatstate.models.rotate's angles, (seq, head_dim / 2) float32, the same way."""
    half = head_dim // 2
    freq = 10000.0 ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angle = torch.arange(seq, device=device, dtype=torch.float32).view(seq, 1) * freq
    return angle.cos(), angle.sin()


def rotate_table(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """coatstate.models.rotate for (batch, heads, seq, head_dim) with the angles' cos and sin given."""
    half, xf = x.shape[-1] // 2, x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1).to(x.dtype)


class BlockTable(GPTBlock):
    """The GPT's block with the rotation's tables passed in: forward(x, (cos, sin))."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.attn.qkv(self.ln1(x)).split(d, 2)
        q, k, v = (t.view(b, s, self.attn.heads, -1).transpose(1, 2) for t in qkv)
        q, k = rotate_table(q, *rope), rotate_table(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class GPTTable(GPT):
    """The GPT whose blocks get the tables, computed once per (seq, device) outside compile."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        key = (idx.shape[1], idx.device)
        if getattr(self, "_tables_key", None) != key:
            head_dim = self.cfg.dim // self.cfg.heads
            self._tables_key, self._tables = key, rope_tables(idx.shape[1], head_dim, idx.device)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, self._tables)
        return F.cross_entropy(self.head(self.ln_f(x)).float().view(-1, 256), targets.reshape(-1))


def swap_blocks(model: GPT, cls: type, args) -> None:
    for i, block in enumerate(model.blocks):
        swapped = cls(model.cfg)
        swapped.load_state_dict(block.state_dict())
        model.blocks[i] = swapped


def build(variant: str, args, device: torch.device):
    torch.manual_seed(0)
    cls = GPTTable if variant == "rope_table" else GPT
    model = cls(config(args, "learned" if variant == "learned" else "rope"))
    if variant in ("rope_bshd", "rope_table"):
        swap_blocks(model, BlockBSHD if variant == "rope_bshd" else BlockTable, args)
    model.to(device)
    for block in model.blocks:
        block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt


def same_function(args) -> float:
    """Max |GPTBlock(rope) - BlockBSHD| on one random input, eager fp32 on CPU: the candidate layout
    must compute the harness's function before its time means anything."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=256, layers=1, dim=64, heads=2, seq=16, positions="rope")
    a, b = GPTBlock(cfg), BlockBSHD(cfg)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


def table_bitwise(args, device: torch.device) -> dict:
    """rope_table against rope on one block of the run's width, same weights and input, bf16
    autocast as in training: max |difference| of the output, the input's gradient and the
    parameters' gradients, eager and (on CUDA, where inductor writes Triton) compiled. All 0.0: the
    table changes no bit of a run."""
    torch.manual_seed(0)
    ref = GPTBlock(config(args)).to(device)
    new = BlockTable(config(args)).to(device)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, args.seq, args.dim, device=device)
    up = torch.randn(2, args.seq, args.dim, device=device)
    tables = rope_tables(args.seq, args.dim // args.heads, device)
    out = {}
    for mode in ("eager", "compiled") if device.type == "cuda" else ("eager",):
        results = []
        for block, extra in ((ref, ()), (new, (tables,))):
            fn = torch.compile(block) if mode == "compiled" else block
            xi = x.clone().requires_grad_()
            block.zero_grad(set_to_none=True)
            with torch.autocast(device.type, torch.bfloat16):
                y = fn(xi, *extra)
            y.float().backward(up)
            results.append([y.detach().float(), xi.grad] + [p.grad for p in block.parameters()])
        out[mode] = max((a.float() - b.float()).abs().max().item() for a, b in zip(*results, strict=True))
    return out


def make_step(model, opt, args, device):
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)

    def step():
        with torch.autocast(device.type, torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_steps(step, n: int, device) -> float:
    """Milliseconds per step over n back-to-back steps."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return 1e3 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def kernel_profile(step, device, top: int) -> dict:
    """The top CUDA kernels by total time over 3 steps, and the attention kernels among all."""
    if device.type != "cuda":
        return {"top": [], "attention": []}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    as_row = lambda e: {"name": e.key[:120], "ms_per_step": e.device_time_total / 3e3, "calls": e.count // 3}
    words = ("flash", "fmha", "attention", "sdpa", "cudnn", "softmax", "bmm")
    attention = [as_row(e) for e in rows if any(w in e.key.lower() for w in words)]
    return {"top": [as_row(e) for e in rows[:top]], "attention": attention}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="back-to-back steps per timing")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after building (compiles)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--top", type=int, default=8, help="kernels listed per variant")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200 SXM)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes, 2 rounds")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "parity_step_profile.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.layers, args.dim, args.heads = 2, 64, 2, 64, 2
        args.rounds, args.steps, args.warmup = 2, 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch._dynamo.config.recompile_limit = 64  # 14 block instances, as in parity_gpu
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")

    same = same_function(args)
    print(f"rope_bshd against rope, one eager fp32 block: max abs difference {same:.1e}")
    if same > 1e-5:
        raise SystemExit("rope_bshd does not compute rope's function: fix it before timing it")
    bitwise = table_bitwise(args, device)
    print(f"rope_table against rope, one block, bf16 autocast: max abs difference {bitwise}")
    built = {}
    for v in variants:
        model, opt = build(v, args, device)
        step = make_step(model, opt, args, device)
        for _ in range(args.warmup):
            step()
        built[v] = (model, step)
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(time_steps(built[v][1], args.steps, device))

    tokens = args.batch * args.seq
    rows = []
    for v in variants:
        params = sum(p.numel() for p in built[v][0].parameters())
        flops = 6 * params * tokens + 6 * args.layers * args.batch * args.seq**2 * args.dim  # causal: half
        ms = statistics.median(times[v])
        rows.append(dict(variant=v, params=params, times_ms=times[v], step_ms=ms,
                         spread_ms=[min(times[v]), max(times[v])], tokens_per_s=tokens / ms * 1e3,
                         compute_floor_ms=flops / (args.peak_tflops * 1e12) * 1e3,
                         kernels=kernel_profile(built[v][1], device, args.top)))  # fmt: skip
    shape = f"{args.layers} x {args.dim}, batch {args.batch} x {args.seq}"
    print(f"{device}, {shape}, median of {args.rounds} rounds")
    print(f"{'variant':<10} {'params':>12} {'step ms':>9} {'min-max':>15} {'tokens/s':>10} {'floor ms':>9}")
    for r in rows:
        lo, hi = r["spread_ms"]
        print(f"{r['variant']:<10} {r['params']:>12,} {r['step_ms']:>9.2f} {f'{lo:.2f}-{hi:.2f}':>15} "
              f"{r['tokens_per_s']:>10,.0f} {r['compute_floor_ms']:>9.2f}")  # fmt: skip
    for r in rows:
        for k in r["kernels"]["attention"][:4]:
            per_step = f"{k['ms_per_step']:7.2f} ms/step x{k['calls']}"
            print(f"  {r['variant']:<10} attention kernel {per_step}  {k['name']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = result_meta(args, str(device))
    meta |= {"rope_bshd_max_abs_diff": same, "rope_table_max_abs_diff": bitwise}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
