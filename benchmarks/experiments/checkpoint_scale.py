"""Per-rank checkpoints at 1, 2 and 4 ranks: time the training loop is blocked per save, write
throughput beside the disk's own, and load time.

    python benchmarks/experiments/checkpoint_scale.py  # CPU, gloo, 1/2/4 ranks, ~28M params
    python benchmarks/experiments/checkpoint_scale.py --device cuda  # one GPU, the 1.31B GPT-shaped set
    python benchmarks/experiments/checkpoint_scale.py --smoke               # a few seconds (CI)

Each rank holds a GPT-shaped parameter set (benchmarks/common.py's gpt_shapes) sharded on
dim 0 (DTensors, as FSDP2 holds them; on CUDA, world size 1, plain tensors) and a CompressedAdamW
state after one step; a checkpoint holds the float32 weights (as the model state dict) and the
compressed states (--no-model: the states only). Per round, in an order that rotates between
rounds, on every rank:
  blocking   coatstate.save(opt, url, model=weights, distributed="per_rank")
  async      coatstate.save(..., blocking=False); the handle's wait() measured apart
  dcp_async  torch.distributed.checkpoint.async_save of the same tensors
  floor      write + fsync of a raw file as large as the rank's own per-rank file, from one cache-hot
             1 MiB block (the disk and the page cache alone)
  floor_mem  the same from a host buffer as large as the file (the disk, plus reading the bytes from
             memory as every checkpoint writer must): the floor a save can reach
  load       coatstate.load of the per-rank checkpoint's states into a fresh optimizer (warm page cache)
"blocked" is the caller's time in the call (what the training loop waits for); "total" includes the
background write until committed. Times are the slowest rank's (a barrier before, a max after).
GB/s = bytes of the checkpoint / total. For blocking and async saves rank 0 also records where
its time goes (PHASES: DCP's save or async_save call, and the removal of the replaced version).
Prints a table (median and min-max over rounds) and writes JSON to --out. Needs no network (the
process group runs on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import median_range, result_meta  # noqa: E402
from helpers import fmt_median_range, stepped_optimizer  # noqa: E402

VARIANTS = ("blocking", "async", "dcp_async", "floor", "floor_mem", "load")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank: int, world_size: int, port: int, device: str, threads: int):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # DCP stages through gloo too
    if device == "cuda":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def _flat_state(opt, model: dict) -> dict[str, torch.Tensor]:
    """What is saved, as DCP takes it: one flat dict of (D)tensors."""
    state = {f"state.{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return state | {f"model.{k}": v for k, v in model.items()}


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


PHASES = (  # (name, module, function): where a per-rank save's time goes (wall s per save)
    ("dcp_save", "torch.distributed.checkpoint", "save"),  # plan + rank files + .metadata (the commit)
    ("dcp_async", "torch.distributed.checkpoint", "async_save"),  # staging (the write: in `other`)
    ("prune", "coatstate.checkpoint.per_rank", "_prune"),  # the replaced version, after the commit
)
_phase_s: dict[str, float] = {}


def _time_phases() -> None:
    """Wrap PHASES' functions so that each call adds its wall time to _phase_s (they are looked
    up by module attribute at call time, also from the background thread)."""
    import importlib

    for name, module, function in PHASES:
        mod = importlib.import_module(module)
        inner = getattr(mod, function)

        def timed(*a, _inner=inner, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                _phase_s[_name] = _phase_s.get(_name, 0.0) + time.perf_counter() - t0

        setattr(mod, function, timed)


def _timed(fn) -> tuple[float, float]:
    """(blocked, total) seconds of the slowest rank; fn returns a wait callable or None."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    wait = fn()
    blocked = time.perf_counter() - t0
    if wait is not None:
        wait()
    total = time.perf_counter() - t0
    return _slowest(blocked), _slowest(total)


def _dcp_async(opt, model: dict, directory: str):
    """Start torch.distributed.checkpoint.async_save of the state; returns its wait."""
    import torch.distributed.checkpoint as dcp

    res = dcp.async_save(_flat_state(opt, model), checkpoint_id=directory)
    return getattr(res, "upload_completion", res).result  # a Future, or (2.7+) its response


def _floor(path: str, nbytes: int) -> None:
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.write(block[: nbytes & ((1 << 20) - 1)])
        f.flush()
        os.fsync(f.fileno())


def _floor_from(path: str, buffer: torch.Tensor) -> None:
    view, step = memoryview(buffer.numpy()), 64 << 20
    with open(path, "wb") as f:
        for at in range(0, len(view), step):
            f.write(view[at : at + step])
        f.flush()
        os.fsync(f.fileno())


def _round(opt, model, fresh, args, url: str, rank: int, index: int, results: dict, buffer) -> None:
    """One round: every variant once, in an order that rotates with `index`, then a load."""
    import torch.distributed as dist

    import coatstate
    from coatstate.checkpoint import wait_for_saves

    dcp_dir, floor_file = os.path.join(args.dir, f"dcp{index}"), os.path.join(args.dir, f"floor-{rank}")

    def blocking():
        coatstate.save(opt, url, model=model or None, distributed="per_rank")

    def background():
        return coatstate.save(opt, url, model=model or None, distributed="per_rank", blocking=False).wait

    def dcp_async():
        return _dcp_async(opt, model, dcp_dir)

    plan = {
        "blocking": blocking,
        "async": background,
        "dcp_async": dcp_async,
        "floor": lambda: _floor(floor_file, buffer.numel()),
        "floor_mem": lambda: _floor_from(floor_file + "-mem", buffer),
    }
    names = list(plan)
    for name in names[index % len(names) :] + names[: index % len(names)]:
        _phase_s.clear()
        results[name].append(_timed(plan[name]))
        wait_for_saves()  # the replaced files' removal, after the commit: timed as a phase only
        if name in ("blocking", "async"):
            results.setdefault(f"phases/{name}", []).append(dict(_phase_s))
    results["load"].append(_timed(lambda: coatstate.load(fresh, url) and None))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(dcp_dir, ignore_errors=True)
    os.unlink(floor_file)
    os.unlink(floor_file + "-mem")


def _sizes(url: str, rank: int) -> tuple[int, int]:
    """(bytes of the whole per-rank checkpoint, bytes of this rank's file)."""
    from coatstate.checkpoint import latest

    version = latest(url)
    sizes = {n: os.path.getsize(os.path.join(version, n)) for n in os.listdir(version)}
    return sum(sizes.values()), sizes.get(f"__{rank}_0.distcp", 0)


def _worker(rank: int, world_size: int, port: int, args, out: str) -> None:
    import torch.distributed as dist

    import coatstate

    if args.device == "cuda":
        torch.cuda.set_device(rank)
    mesh = _setup(rank, world_size, port, args.device, args.threads)
    opt, model, numel = stepped_optimizer(args.device, args.vocab, args.scale, mesh, not args.no_model)
    fresh, _, _ = stepped_optimizer(args.device, args.vocab, args.scale, mesh, False)  # loaded into
    _time_phases()
    url = os.path.join(args.dir, "ckpt")
    # warm-up, not measured: imports, thread pools, the first files, pinned buffers, DCP's planner
    coatstate.save(opt, url, model=model or None, distributed="per_rank")
    coatstate.save(opt, url, model=model or None, distributed="per_rank", blocking=False).wait()
    _dcp_async(opt, model, os.path.join(args.dir, "dcp_warmup"))()
    total, mine = _sizes(url, rank)
    results: dict[str, list] = {v: [] for v in VARIANTS}
    buffer = torch.ones(mine, dtype=torch.uint8)  # floor_mem's source: every page touched, like a snapshot
    for r in range(args.rounds):
        _round(opt, model, fresh, args, url, rank, r, results, buffer)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world_size": world_size, "params": numel, "bytes": total, "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------- report
def summarize(run: dict) -> list[dict]:
    """One row per variant: blocked and total seconds, GB/s (checkpoint bytes / total)."""
    rows, results = [], run["results"]
    for variant, pairs in results.items():
        if variant.startswith("phases/"):
            continue
        blocked, total = [b for b, _ in pairs], [t for _, t in pairs]
        row = {
            "world_size": run["world_size"],
            "variant": variant,
            "blocked_s": median_range(blocked),
            "total_s": median_range(total),
            "gbps": median_range([run["bytes"] / t / 1e9 for t in total]),
            "bytes": run["bytes"],
            "params": run["params"],
        }
        phases = results.get(f"phases/{variant}")
        if phases:  # rank 0's, median per phase over rounds
            row["phases_s"] = {n: statistics.median(p.get(n, 0.0) for p in phases) for n, *_ in PHASES}
        rows.append(row)
    return rows


def print_phases(rows: list[dict]) -> None:
    timed = [r for r in rows if "phases_s" in r]
    if not timed:
        return
    print(f"\nwhere rank 0's time goes, median s per save ({', '.join(n for n, *_ in PHASES)}; the rest of")
    print("'total' is waiting: for the background write, the device-to-host")
    print("copies, the other ranks, ...)")
    for r in timed:
        cells = "  ".join(f"{n} {r['phases_s'][n]:.3f}" for n, *_ in PHASES)
        print(f"{r['world_size']:>5} {r['variant']:<10} {cells}  total {r['total_s']['median']:.3f}")


def print_table(rows: list[dict]) -> None:
    print(f"{'ranks':>5} {'variant':<10} {'blocked s':>24} {'total s':>24} {'GB/s':>22}")
    for r in rows:
        blocked, total = fmt_median_range(r["blocked_s"]), fmt_median_range(r["total_s"])
        gbps = fmt_median_range(r["gbps"], fmt="{:.2f}")
        print(f"{r['world_size']:>5} {r['variant']:<10} {blocked:>24} {total:>24} {gbps:>22}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", default=None, help="world sizes, e.g. 1,2,4 (default: 1,2,4 on CPU, 1 on CUDA)")
    p.add_argument("--scale", type=float, default=None, help="gpt_shapes scale (default 0.05 CPU, 1.0 CUDA)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (1 CPU, all CUDA)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny set, 1 and 2 ranks: a few seconds")
    p.add_argument("--no-model", action="store_true", help="save the optimizer states only (no weights)")
    args = p.parse_args(argv)
    if args.smoke:
        args.scale, args.vocab, args.ranks = args.scale or 0.0005, 512, args.ranks or "1,2"
    args.scale = args.scale or (1.0 if args.device == "cuda" else 0.05)
    args.threads = args.threads or (os.cpu_count() or 1 if args.device == "cuda" else 1)
    worlds = [int(w) for w in (args.ranks or ("1" if args.device == "cuda" else "1,2,4")).split(",")]
    out = args.out or str(
        Path(__file__).resolve().parent / "results" / f"checkpoint_scale_{args.device}.json"
    )
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    multiprocessing.set_forkserver_preload(["torch", "coatstate"])
    import torch.multiprocessing as mp

    rows, meta = [], result_meta(device=args.device)
    base = args.dir
    for world_size in worlds:
        args.dir = tempfile.mkdtemp(prefix=f"ckpt_scale_{world_size}_", dir=base)
        part = os.path.join(args.dir, "result.json")
        try:
            mp.start_processes(
                _worker,
                args=(world_size, _free_port(), args, part),
                nprocs=world_size,
                start_method="forkserver",
            )
            with open(part) as f:
                rows += summarize(json.load(f))
        finally:
            shutil.rmtree(args.dir, ignore_errors=True)
    print_table(rows)
    print_phases(rows)
    params, nbytes = rows[0]["params"], rows[0]["bytes"]
    print(
        f"{params / 1e6:.1f}M params, checkpoint {nbytes / 1e6:.1f} MB; rounds {args.rounds}; "
        f"{meta['machine']}"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    report = {
        "meta": meta,
        "args": {k: v for k, v in vars(args).items() if k != "dir"} | {"dir": base or "temporary"},
        "rows": rows,
    }
    Path(out).write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
