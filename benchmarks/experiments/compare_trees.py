"""python benchmarks/experiments/compare_trees.py OLD_PKG_DIR [--rounds 3]        (CUDA)

benchmarks/optimizer_step.py of this tree against an older one, interleaved over rounds in
separate processes on the same GPU: a refactor must not move the step time. OLD_PKG_DIR holds an
importable `coatstate` package of the old code (its formats/ and kernels/ copied in as
coatstate/formats and coatstate/kernels) and OLD_PKG_DIR/../benchmarks/optimizer_step.py its
benchmark. Per variant: the median back-to-back step time over rounds of each tree, its min-max,
and new / old. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(tree: str, script: str, pythonpath: str | None, out: str, extra: list[str]) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, script, "--out", out, *extra]
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return {r["name"] + " " + r["dtype"]: r["pipelined_ms"] for r in json.load(f)["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_pkg_dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--args", default="--which coat --dtypes float32 --steps 20")
    ap.add_argument("--out", default="benchmarks/experiments/results/compare_trees.json")
    args = ap.parse_args()
    old_pkg = os.path.abspath(args.old_pkg_dir)
    old_tree = os.path.dirname(old_pkg)
    extra = args.args.split()
    times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for label, tree, path in (("old", old_tree, old_pkg), ("new", os.path.dirname(HERE), None)):
                script = os.path.join(tree, "benchmarks", "optimizer_step.py")
                got = run(tree, script, path, os.path.join(tmp, f"{label}{rnd}.json"), extra)
                for name, ms in got.items():
                    times[label].setdefault(name, []).append(ms)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    rows = []
    spread = f"{'(min-max)':>15s}"
    print(f"{'variant':56s} {'old ms':>8s} {spread} {'new ms':>8s} {spread} {'new/old':>7s}")
    for name, old in times["old"].items():
        new = times["new"].get(name, [])
        if not new:
            continue
        o, n = statistics.median(old), statistics.median(new)
        rows.append(dict(name=name, old_ms=old, new_ms=new, old_median=o, new_median=n, ratio=n / o))
        print(
            f"{name:56s} {o:8.3f} {min(old):7.3f}-{max(old):7.3f} {n:8.3f} {min(new):7.3f}-{max(new):7.3f} "
            f"{n / o:7.3f}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(rounds=args.rounds, args=args.args, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
