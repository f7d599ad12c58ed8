"""Host (Python) time of compress_activations per training step, measured on CPU.

    python benchmarks/experiments/activation_host.py                  # 24 layers, as GPT-2-medium; ~1 min
    python benchmarks/experiments/activation_host.py --rounds 5       # quicker, noisier
    python benchmarks/experiments/activation_host.py --baseline old.json  # also against older code
    python benchmarks/experiments/activation_host.py --device cuda \
        --out benchmarks/experiments/results/activation_host_cuda.json

On the H200 the GPT-2-medium step is host-bound with compression on (benchmarks/activation_memory.py:
the GPU time per step is that of the uncompressed step, the host's is not), so what counts is the
Python work per saved tensor and per op. This script isolates it: a GPT with the GPT-2-medium
layer count (--layers 24) but tiny tensors (d=32, seq 16, batch 1) on one CPU thread, so the
compute is negligible and every forward saves the same tensors, in the same number, as the big
model does (min_numel=0: every activation is as big as min_numel there).

Times are CPU time of the calling thread (time.thread_time: other processes on a busy machine
do not add to it; one torch thread, and the CPU autograd engine runs on the caller's thread).
Variants, each timed for forward and backward separately (median over --rounds rounds, the
variants interleaved in each round so machine load affects all alike):
- none: no hooks;
- identity hooks: a saved_tensors_hooks pair that returns what it gets (the cost of the hook
  mechanism itself, the floor under any hook-based variant; its per-save figures use the saves
  that `hooks only` counts);
- keep floor: a hook pair that wraps each save in the record compress_activations keeps for an
  uncompressed tensor (detached, with its version) and nothing else: what any correct keep costs;
- inspect floor: the keep floor plus the reads every decision of the real hook starts from (the
  caller's frame, grad_fn and its sequence number, storage pointer, offset and strides);
- hooks only: compress_activations with every kind kept (its bookkeeping, no packing);
- compress (torch twin): the default policy on the pure-torch codec (the CPU path: its cost is
  the codec's dozen torch ops per tensor, not what the GPU path runs);
- compress (kernel path, no launch): the default policy on the path CUDA runs (backend="triton"),
  with the two methods of kernels.activation._Launcher that reach the GPU (compile, launch)
  replaced by no-ops: every other host step of the GPU path runs (buffers, slots, argument
  specialization keys, bookkeeping). Its codes are garbage, so its backward computes garbage
  gradients, but the same host work.

--device cuda runs the same tiny model on the GPU (compute still negligible: the step is host-bound
by construction) with "compress (kernel path)" launching the real kernels instead of the torch
twin, so that the difference to "kernel path, no launch" is what the launches cost the host. There
the forward is timed by the wall clock (host time to issue it) and the backward to its end.

Reported per variant: ms per forward and backward, the overhead over `none`, and that overhead per
saved tensor (every save autograd makes) and per op (torch function calls in the forward, counted
once with a TorchFunctionMode outside the timing); for the compressing variants also the extra
host time per compressed tensor over `hooks only`. JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import result_meta  # noqa: E402

from coatstate.activations import KEEP_ALL, compress_activations  # noqa: E402
from coatstate.models import GPT, ModelConfig  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round (median taken)")
    p.add_argument("--out", default="benchmarks/experiments/results/activation_host.json")
    p.add_argument(
        "--cprofile",
        default=None,
        help="write cProfile tables (by own time) of each compressing variant's steps to this file",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="JSON of an earlier run of this script (e.g. on older code) to compare with",
    )
    return p.parse_args()


@contextlib.contextmanager
def _no_launch():
    """The kernel path with the GPU calls of kernels.activation._Launcher replaced by no-ops."""
    from coatstate.kernels import activation as K
    from triton.compiler.compiler import CompiledKernel

    stub = object.__new__(CompiledKernel)  # a compiled kernel as far as the launcher's cache cares
    stub.module = stub._module_pid = None  # (read when it is collected)
    saved = K._Launcher.compile, K._Launcher.launch
    launchers = [v for v in vars(K).values() if isinstance(v, K._Launcher)]
    caches = [launcher.compiled for launcher in launchers]
    K._Launcher.compile = lambda self, grid, args, constexprs: stub
    K._Launcher.launch = lambda self, compiled, device, grid, args, constexprs: None
    for launcher in launchers:
        launcher.compiled = {}  # (the stub must not stay in the real caches)
    try:
        yield
    finally:
        K._Launcher.compile, K._Launcher.launch = saved
        for launcher, cache in zip(launchers, caches, strict=True):
            launcher.compiled = cache


def _variants(device: str) -> dict:
    """name -> (context factory, whether the kernel launches are stubbed out)."""
    out = {
        "none": (contextlib.nullcontext, False),
        "identity hooks": (lambda: torch.autograd.graph.saved_tensors_hooks(_same, _same), False),
        "keep floor": (lambda: torch.autograd.graph.saved_tensors_hooks(_keep_floor, _kept_tensor), False),
        "inspect floor": (
            lambda: torch.autograd.graph.saved_tensors_hooks(_inspect_floor, _kept_tensor),
            False,
        ),
        "hooks only (all kept)": (lambda: compress_activations(min_numel=0, **KEEP_ALL), False),
    }
    if device == "cuda":
        out["compress (kernel path)"] = (lambda: compress_activations(min_numel=0, backend="triton"), False)
        out["compress (kernel path, recompute=False)"] = (
            lambda: compress_activations(min_numel=0, backend="triton", recompute=False),
            False,
        )
    else:
        out["compress (torch twin)"] = (lambda: compress_activations(min_numel=0, backend="torch"), False)
    out["compress (kernel path, no launch)"] = (
        lambda: compress_activations(min_numel=0, backend="triton"),
        True,
    )
    return out


def _same(x):
    return x


class _Kept:
    """The shape of compress_activations' record of a kept save (a slotted class, three fields)."""

    __slots__ = ("tensor", "version", "reason")

    def __init__(self, tensor: torch.Tensor, version: int, reason: str) -> None:
        self.tensor, self.version, self.reason = tensor, version, reason


def _keep_floor(x):
    return _Kept(x.detach() if x.requires_grad else x, x._version, "floor")


def _inspect_floor(x):
    sys._getframe(1)
    node = x.grad_fn
    if node is not None:
        node._sequence_nr()
    x.untyped_storage().data_ptr(), x.storage_offset(), x.stride()
    return _Kept(x.detach() if x.requires_grad else x, x._version, "floor")


def _kept_tensor(saved):
    return saved.tensor


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _step(model, idx, make_ctx) -> tuple[float, float, object]:
    ctx = make_ctx()
    if idx.is_cuda:  # host time to issue the forward; backward (other threads) to its end
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx:
            loss = model(idx, idx)
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, ctx
    t0 = time.thread_time()
    with ctx:
        loss = model(idx, idx)
    t1 = time.thread_time()
    loss.backward()  # (on CPU the autograd engine runs on this thread)
    t2 = time.thread_time()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, ctx


def _cprofile(model, idx, variants, args) -> None:
    """Where the host time of each compressing variant goes: cProfile, by own time."""
    import cProfile
    import io
    import pstats

    text = io.StringIO()
    for name, (make, stubbed) in list(variants.items())[1:]:
        prof = cProfile.Profile()
        with _no_launch() if stubbed else contextlib.nullcontext():
            prof.enable()
            for _ in range(args.steps):
                _step(model, idx, make)
            prof.disable()
        model.zero_grad(set_to_none=True)
        text.write(f"== {name}: {args.steps} steps\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    Path(args.cprofile).parent.mkdir(parents=True, exist_ok=True)
    Path(args.cprofile).write_text(text.getvalue())
    print(f"wrote {args.cprofile}")


def _compare(baseline: dict, rows: list[dict]) -> None:
    """Print each variant's forward overhead against an earlier run's, and both runs' times as
    multiples of their own `none` (this machine's speed drifts between runs)."""
    before = {r["variant"]: r for r in baseline["rows"]}
    for r in rows[1:]:
        b = before.get(r["variant"])
        if b is not None:
            ratio = r["fwd_overhead_ms"] / b["fwd_overhead_ms"]
            was = [b[k] / before["none"][k] for k in ("fwd_ms", "bwd_ms")]
            now = [r[k] / rows[0][k] for k in ("fwd_ms", "bwd_ms")]
            print(
                f"{r['variant']:<36} forward overhead {b['fwd_overhead_ms']:.2f} -> "
                f"{r['fwd_overhead_ms']:.2f} ms ({ratio:.2f}x) vs baseline; fwd x{was[0]:.2f} -> "
                f"x{now[0]:.2f}, bwd x{was[1]:.2f} -> x{now[1]:.2f} of none"
            )


def main() -> None:
    args = _parse()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=64, layers=args.layers, dim=args.dim, heads=2, seq=args.seq)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; run on CPU (the default)")
    model = GPT(cfg).to(args.device)
    idx = torch.randint(0, cfg.vocab, (1, cfg.seq), device=args.device)
    variants = _variants(args.device)
    counter = _CountOps()
    with counter:
        model(idx, idx)
    stats = {}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for r in range(args.rounds + 1):  # round 0 warms up (call-site and kernel caches)
        for name, (make, stubbed) in variants.items():
            with _no_launch() if stubbed else contextlib.nullcontext():
                steps = [_step(model, idx, make) for _ in range(args.steps)]
                model.zero_grad(set_to_none=True)
                if r:
                    fwd = statistics.median(s[0] for s in steps)
                    bwd = statistics.median(s[1] for s in steps)
                    times[name].append((fwd, bwd))
                stats[name] = getattr(steps[-1][2], "stats", None)
    rows = []
    base = None
    hooks_saves = stats["hooks only (all kept)"]
    hooks_saves = hooks_saves.packed + hooks_saves.kept + hooks_saves.shared + hooks_saves.recomputed
    for name, t in times.items():
        fwd = statistics.median(x[0] for x in t)
        bwd = statistics.median(x[1] for x in t)
        row = {"variant": name, "fwd_ms": fwd, "bwd_ms": bwd}
        s = stats[name]
        if s is not None:
            row.update(
                saves=s.packed + s.kept + s.shared + s.recomputed,
                packed=s.packed,
                recomputed=s.recomputed,
                shared=s.shared,
                kept=s.kept,
            )
        if base is None:
            base = row
        else:
            row["fwd_overhead_ms"] = fwd - base["fwd_ms"]
            row["bwd_overhead_ms"] = bwd - base["bwd_ms"]
            row["fwd_us_per_save"] = 1e3 * row["fwd_overhead_ms"] / row.get("saves", hooks_saves)
            row["fwd_us_per_op"] = 1e3 * row["fwd_overhead_ms"] / counter.calls
        rows.append(row)
    hooks = next(r for r in rows if r["variant"] == "hooks only (all kept)")
    for row in rows[rows.index(hooks) + 1 :]:
        row["fwd_us_per_packed_over_hooks"] = 1e3 * (row["fwd_ms"] - hooks["fwd_ms"]) / max(1, row["packed"])
        row["bwd_us_per_packed_over_hooks"] = 1e3 * (row["bwd_ms"] - hooks["bwd_ms"]) / max(1, row["packed"])
    print(
        f"GPT {args.layers} layers, d={args.dim}, seq {args.seq}, batch 1, {args.device}, 1 CPU thread; "
        f"{counter.calls} torch calls and {hooks['saves']} saved tensors per forward; median of "
        f"{args.rounds} rounds"
    )
    head = f"{'variant':<36} {'fwd ms':>8} {'bwd ms':>8} {'+fwd ms':>8} {'us/save':>8} {'us/op':>7}"
    print(head + f" {'us/packed':>10}")
    for r in rows:
        print(
            f"{r['variant']:<36} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r.get('fwd_overhead_ms', 0):8.2f} "
            f"{r.get('fwd_us_per_save', 0):8.2f} {r.get('fwd_us_per_op', 0):7.2f} "
            f"{r.get('fwd_us_per_packed_over_hooks', 0):10.1f}"
        )
    if args.cprofile:
        _cprofile(model, idx, variants, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "meta": result_meta(args),
        "args": vars(args),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    result.update(ops_per_forward=counter.calls, rows=rows)
    if args.baseline:
        result["baseline"] = json.loads(Path(args.baseline).read_text())
        _compare(result["baseline"], rows)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
