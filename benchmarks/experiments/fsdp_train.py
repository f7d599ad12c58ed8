"""FSDP2 + CompressedAdamW on several GPUs: equivalence with one process, then GPT throughput and memory.

    torchrun --standalone --nproc-per-node 2 benchmarks/experiments/fsdp_train.py            # 2 GPUs, NCCL
    torchrun --standalone --nproc-per-node 2 benchmarks/experiments/fsdp_train.py --smoke    # tiny, CPU, gloo

1. Equivalence (--check-steps, 10): a small MLP with an uneven row count (131 rows: 66 + 65 per
   rank) sharded with fully_shard, CompressedAdamW (the fused Triton step on CUDA, run on each
   rank's local shard), every rank fed the same batch, against the same model and optimizer in
   one process on rank 0. Parameters and every state tensor (codes, scales, exponents, float32
   moments) are compared bit for bit; then a DCP save, a load into a fresh FSDP2 model, and
   coatstate.read of the DCP directory (whole tensors) must give the same bits again. On CPU the
   pure-torch step runs (tests/integration/test_fsdp2_ddp.py explains its 1-ulp caveat for uneven shards).
2. Throughput (--layers/--dim: 24 x 2048, a 1.31B-parameter GPT from coatstate.models):
   FSDP2 (bf16 compute, fp32 reduce) with CompressedAdamW + compress_activations against FSDP2
   with torch.optim.AdamW(fused=True), and CompressedAdamW alone (what the optimizer buys).
   Tokens/s over all ranks (median step after --warmup) and peak allocated memory per GPU, side
   by side; JSON to --out (benchmarks/experiments/results/fsdp_train.json).
"""

from __future__ import annotations

import os

# set before torch.distributed starts: NVLink multicast (NVLS) is off on the lent machines
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic GEMMs for the equivalence check

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import add_shape_args, result_meta, shape_config  # noqa: E402
from helpers import log_rank0, token_batch, torchrun_setup  # noqa: E402

import coatstate  # noqa: E402
from coatstate import CompressedAdamW, compress_activations  # noqa: E402
from coatstate.distributed import full_tensor  # noqa: E402
from coatstate.models import GPT, ModelConfig  # noqa: E402

VARIANTS = {  # --variants: column titles
    "coatstate": "CompressedAdamW+compress_act",
    "coatstate_optimizer": "CompressedAdamW only",
    "torch": "torch AdamW (fused)",
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU with gloo")
    p.add_argument("--check-steps", type=int, default=10)
    add_shape_args(p, dim=2048, batch_help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--variants",
        default="coatstate,coatstate_optimizer,torch",
        help=f"comma-separated, of {list(VARIANTS)}",
    )
    p.add_argument("--out", default=None, help="JSON path (default experiments/results/fsdp_train.json)")
    args = p.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown --variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    if args.smoke:
        args.layers, args.dim, args.heads, args.seq, args.batch, args.vocab = 2, 128, 4, 64, 2, 512
        args.loss_chunks, args.steps, args.warmup = 2, 3, 1
    if args.out is None:
        default = Path(tempfile.gettempdir()) / "fsdp_train_smoke.json" if args.smoke else None
        args.out = str(default or Path(__file__).resolve().parent / "results" / "fsdp_train.json")
    return args


# ------------------------------------------------------------------------------ 1. equivalence
def _mlp(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 131),
        torch.nn.LayerNorm(131),
        torch.nn.Linear(131, 128),
    ).to(device)


def _mlp_steps(model, opt, device, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 128, generator=gen)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[f"{name}/param"] = full_tensor(p).detach().cpu().clone()
        for key, value in opt.state[p].items():
            out[f"{name}/{key}"] = full_tensor(value).detach().cpu().clone()
    return out


def _compare(got: dict, want: dict) -> dict:
    """{"tensors", "bit_exact", "differing": {key: (elements, max abs diff)}}."""
    diff = {}
    for key, w in want.items():
        g = got[key]
        a, b = (g.view(torch.uint8), w.view(torch.uint8)) if w.element_size() == 1 else (g, w)
        if g.shape != w.shape or not torch.equal(a, b):
            n = int((a != b).sum()) if g.shape == w.shape else -1
            d = (g.float() - w.float()).abs().max().item() if g.shape == w.shape else float("nan")
            diff[key] = (n, d)
    return {"tensors": len(want), "bit_exact": not diff, "differing": diff}


def equivalence(mesh, device, steps: int, workdir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def sharded():
        model = _mlp(device)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = sharded()
    opt = CompressedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _mlp_steps(model, opt, device, 0, steps)
    got = _snapshot(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=workdir)

    fresh = sharded()
    fresh_opt = CompressedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=workdir)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    reloaded = _snapshot(fresh, fresh_opt)
    result = {}
    if dist.get_rank() == 0:
        ref = _mlp(device)
        ref_opt = CompressedAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        _mlp_steps(ref, ref_opt, device, 0, steps)
        want = _snapshot(ref, ref_opt)
        result["fsdp_vs_one_process"] = _compare(got, want)
        result["dcp_reload"] = _compare(reloaded, got)
        whole = coatstate.read(workdir).optimizer["state"]
        names = [n for n, _ in ref.named_parameters()]
        from_dir = {f"{names[pid]}/{k}": v for pid, s in whole.items() for k, v in s.items()}
        result["dcp_dir_read"] = _compare(
            from_dir, {k: v for k, v in got.items() if not k.endswith("/param")}
        )
        result["fused_step_used"] = bool(
            getattr(opt, "_fused_cache", None)
        )  # launch plans exist only for the Triton step
    dist.barrier()
    return result


# ------------------------------------------------------------------------------- 2. throughput
def throughput(variant: str, cfg: ModelConfig, args, mesh, device) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    params = sum(p.numel() for p in model.parameters())
    if variant.startswith("coatstate"):
        opt = CompressedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        context = compress_activations if variant == "coatstate" else _nothing
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
        context = _nothing
    times, losses = [], []
    cuda = device.type == "cuda"
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x, y = token_batch(cfg, args.batch, step, device)
        t0 = time.perf_counter()
        with context():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    state = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"peak_bytes": peak, "state_bytes": state})
    step_s = statistics.median(times)
    tokens = args.batch * cfg.seq * dist.get_world_size()
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {
        "variant": variant,
        "params": params,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / dist.get_world_size(),
        "peak_gib_per_gpu": [r["peak_bytes"] / 2**30 for r in per_rank],
        "optimizer_state_mib_per_gpu": [r["state_bytes"] / 2**20 for r in per_rank],
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _table(rows: list[dict]) -> str:
    lines = [f"{'':32}" + "".join(f" {VARIANTS[r['variant']]:>29}" for r in rows)]

    def row(label, fmt):
        lines.append(f"{label:32}" + "".join(f" {fmt(r):>29}" for r in rows))

    row("tokens/s (all GPUs)", lambda r: f"{r['tokens_per_s']:,.0f}")
    row("tokens/s per GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}")
    row("step ms (median)", lambda r: f"{r['step_ms']:.1f}")
    for i in range(len(rows[0]["peak_gib_per_gpu"])):
        row(f"peak memory GPU {i} (GiB)", lambda r, i=i: f"{r['peak_gib_per_gpu'][i]:.2f}")
    for i in range(len(rows[0]["optimizer_state_mib_per_gpu"])):
        row(f"optimizer state GPU {i} (MiB)", lambda r, i=i: f"{r['optimizer_state_mib_per_gpu'][i]:,.1f}")
    row("loss first -> last", lambda r: f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    return "\n".join(lines)


def main() -> None:
    args = _parse()
    mesh, device = torchrun_setup(args.smoke)
    world = dist.get_world_size()
    workdir = tempfile.mkdtemp(prefix="fsdp_dcp_") if dist.get_rank() == 0 else None
    box = [workdir]
    dist.broadcast_object_list(box)
    check = equivalence(mesh, device, args.check_steps, box[0])
    if dist.get_rank() == 0:
        for name in ("fsdp_vs_one_process", "dcp_reload", "dcp_dir_read"):
            r = check[name]
            verdict = "bit for bit" if r["bit_exact"] else f"DIFFERS in {len(r['differing'])} tensors"
            log_rank0(f"equivalence {name} ({r['tensors']} tensors, world size {world}): {verdict}")
            for key, (n, d) in r["differing"].items():
                log_rank0(f"    {key}: {n} elements differ, max |diff| {d:.3g}")
        log_rank0(f"fused Triton step used: {check['fused_step_used']}")

    cfg = shape_config(args)
    rows = [throughput(v, cfg, args, mesh, device) for v in args.variants.split(",")]
    log_rank0(
        f"\nGPT {rows[0]['params'] / 1e9:.3f}B params, {world} x {device.type}, batch {args.batch} x seq "
        f"{args.seq} per GPU, bf16 compute, {args.steps} timed steps after {args.warmup}"
    )
    log_rank0(_table(rows))
    if dist.get_rank() == 0:
        meta = result_meta(device=str(device)) | {"world_size": world, "config": vars(args)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "equivalence": check, "runs": rows}, f, indent=1, default=str)
        log_rank0(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
