"""Load time of a CompressedAdamW checkpoint into an optimizer of the same format, single-file and
per-rank, beside the floor of reading its bytes; optionally against an older tree.

    python benchmarks/experiments/checkpoint_load.py                         # this tree, CPU, ~1 min
    python benchmarks/experiments/checkpoint_load.py --old /tmp/old_tree  # interleaved with an older checkout

Each round runs one process per tree (in an order that alternates between rounds), which saves the
GPT-shaped set's state (benchmarks/common.py's gpt_shapes at --scale, after one step) in
both layouts to a RAM disk (/dev/shm where there is one: the disk is not what is measured), loads
each once to warm up, then times `coatstate.load` three times (the median counts) and `floor`: a
plain read of the same files' bytes. Prints median [min-max] over rounds per tree and layout and
writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(args) -> None:
    sys.path.insert(0, str(HERE.parent))
    from helpers import stepped_optimizer  # (checkpoint_scale.py's GPT-shaped state, one process)

    import coatstate

    opt, _, _ = stepped_optimizer("cpu", 50304, args.scale, with_model=False)
    fresh, _, _ = stepped_optimizer("cpu", 50304, args.scale, with_model=False)  # loaded into
    from coatstate.optim import state_dict  # (where the load's conversion came from: which tree)

    out = {"tree": str(Path(state_dict.__file__).parents[2])}
    for layout in ("gathered", "per_rank"):
        directory = tempfile.mkdtemp(dir=args.dir)
        url = os.path.join(directory, "ckpt.safetensors")
        coatstate.save(opt, url, distributed=layout)
        coatstate.load(fresh, url)  # warm-up: imports, page cache
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            coatstate.load(fresh, url)
            times.append(time.perf_counter() - t0)
        files = [os.path.join(directory, n) for n in os.listdir(directory)]
        t0 = time.perf_counter()
        nbytes = sum(len(Path(f).read_bytes()) for f in files)
        out[layout] = {
            "load_s": statistics.median(times),
            "floor_s": time.perf_counter() - t0,
            "bytes": nbytes,
        }
        for f in files:
            os.unlink(f)
        os.rmdir(directory)
    print(json.dumps(out))


def _run(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        str(HERE / "checkpoint_load.py"),
        "--child",
        "--scale",
        str(args.scale),
        "--dir",
        args.dir,
    ]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", default=None, help="an older checkout (its coatstate is imported from there)")
    p.add_argument("--scale", type=float, default=0.1, help="gpt_shapes scale (0.1: 67M params)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    p.add_argument("--out", default=str(HERE / "results" / "checkpoint_load.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    sys.path.insert(0, str(HERE.parent))
    from common import median_range, result_meta
    from helpers import fmt_median_range

    trees = {"this tree": HERE.parents[1]} | ({"old": Path(args.old).resolve()} if args.old else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            runs[name].append(_run(trees[name], args))
    print(f"{'tree':<10} {'layout':<9} {'load s':>22} {'floor s (read)':>22} {'MB':>8}")
    rows = []
    for name, results in runs.items():
        for layout in ("gathered", "per_rank"):
            load = median_range([x[layout]["load_s"] for x in results])
            floor = median_range([x[layout]["floor_s"] for x in results])
            nbytes = results[0][layout]["bytes"]
            cells = f"{fmt_median_range(load):>22} {fmt_median_range(floor):>22} {nbytes / 1e6:8.1f}"
            print(f"{name:<10} {layout:<9} {cells}")
            rows.append(
                {
                    "tree": name,
                    "path": results[0]["tree"],
                    "layout": layout,
                    "load_s": load,
                    "floor_s": floor,
                    "bytes": nbytes,
                }
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"meta": result_meta(device="cpu"), "args": vars(args), "rows": rows}, indent=1)
    )
    print(f"{args.rounds} rounds, processes interleaved; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
