"""Host time of the primitive calls compress_activations' hot path is made of, per call.

    python benchmarks/experiments/host_primitives.py                      # CPU: the torch calls only
    python benchmarks/experiments/host_primitives.py --device cuda \
        --out benchmarks/experiments/results/host_primitives_cuda.json

Why: an eager step with compress_activations is host-bound (benchmarks/activation_memory.py), so
its overhead is a count of calls times what each costs on the machine that issues them. This prints
the second factor: a Python call, the tensor reads every save makes, an eager elementwise op, an
allocation, and on CUDA a raw launch of an already compiled Triton kernel and the pack/unpack calls
of coatstate.kernels.activation (allocation + launch). Tensors are small (64 x 1024 bfloat16) so that
the GPU keeps up and the host is what is timed; wall time per call over `--calls` calls, median of
`--rounds` rounds [min-max]. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import median_range, result_meta  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--out", default="benchmarks/experiments/results/host_primitives.json")
    return p.parse_args()


def _time(fn, args, sync) -> dict:
    for _ in range(50):  # warm-up: caches, the caching allocator, compiled kernels
        fn()
    sync()
    per_call = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        per_call.append((time.perf_counter() - t0) / args.calls * 1e6)
        sync()  # (outside the timing: what is timed is the host issuing the calls)
    return median_range(per_call)


def _kernel_calls(x: torch.Tensor) -> dict:
    """name -> call: the pack/unpack functions of the GPU path, and a raw launch of one kernel."""
    from coatstate.formats.fp8 import FP8Format
    from coatstate.kernels import activation as K

    fmt, n, cols = FP8Format.E4M3, x.numel(), x.shape[-1]
    buf = K.pack_groups_flat(x, n, cols, 16, fmt)  # compiles the kernel, fills the launcher's cache
    amax = torch.zeros(4096, dtype=torch.int32, device=x.device)
    scales = torch.empty(4096, dtype=torch.uint8, device=x.device)
    plan = K._PLANS[("groups", n, fmt, cols, 16, None)]
    compiled = next(iter(K._pack_groups.compiled.values()))
    grid, const = (*plan.grid, 1, 1), tuple(plan.const.values())
    kargs = (x, buf, n, plan.n_groups, plan.cols, plan.per_row)
    device = x.get_device()

    def raw_launch():
        compiled.run(grid[0], grid[1], grid[2], K._current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *kargs, *const)  # fmt: skip

    return {
        "Triton launch, compiled kernel (raw)": raw_launch,
        "pack_groups_flat (alloc + 1 launch)": lambda: K.pack_groups_flat(x, n, cols, 16, fmt),
        "unpack_groups_flat (alloc + 1 launch)": lambda: K.unpack_groups_flat(
            buf, n, cols, 16, fmt, torch.bfloat16
        ),
        "pack_tensor_flat (alloc + 2 launches)": lambda: K.pack_tensor_flat(x, n, fmt, amax, scales, 3),
    }


def main() -> None:
    args = _parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; run on CPU (the default)")
    torch.set_num_threads(1)
    x = torch.randn(64, 1024, device=args.device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    calls = {
        "Python call (nothing)": lambda: None,
        "x.untyped_storage().data_ptr()": lambda: x.untyped_storage().data_ptr(),
        "x.grad_fn, x._version, x.stride()": lambda: (x.grad_fn, x._version, x.stride()),
        "x.new_empty(n, uint8)": lambda: x.new_empty(x.numel(), dtype=torch.uint8),
        "x.add(1) (eager elementwise op)": lambda: x.add(1),
        "x.to(float32) (eager cast)": lambda: x.to(torch.float32),
    }
    if args.device == "cuda":
        calls.update(_kernel_calls(x))
    rows = [{"call": name, "us_per_call": _time(fn, args, sync)} for name, fn in calls.items()]
    print(f"host time per call, {args.device}, x: 64 x 1024 bfloat16; median of {args.rounds} rounds")
    for r in rows:
        t = r["us_per_call"]
        print(f"{r['call']:<42} {t['median']:7.2f} us  [{t['min']:.2f}-{t['max']:.2f}]")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": result_meta(args), "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
