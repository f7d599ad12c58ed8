"""The CPU benchmark scripts still run end to end at tiny sizes (they are not imported by the
library, so nothing else would notice a broken script: one once called a helper whose signature
had changed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # every test runs a script in a fresh interpreter (imports, compiles)


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_activation_memory_smoke_interleaves_rounds_and_pairs_ratios(tmp_path):
    """--smoke: eager variants in 2 interleaved rounds; every row has its per-round times, the
    ratio to its base is the median of per-round ratios (the base's own is exactly 1)."""
    out = tmp_path / "act.json"
    _run("benchmarks/activation_memory.py", "--smoke", "--out", str(out))
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) >= {"none", "compress_activations", "hooks only (all kept)"}
    for r in rows.values():
        assert len(r["round_wall_ms"]) == 2 and r["wall_ms"]["min"] <= r["step_ms"] <= r["wall_ms"]["max"]
    assert rows["none"]["wall_vs_base"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 2}
    mine = rows["compress_activations"]
    ratios = sorted(a / b for a, b in zip(mine["round_wall_ms"], rows["none"]["round_wall_ms"], strict=True))
    assert mine["wall_vs_base"]["min"] == ratios[0] and mine["wall_vs_base"]["max"] == ratios[-1]
    assert mine["kernel_ms"] is None and mine["host_bound"] is None  # (no GPU: no kernel time)


def test_rounds_rotate_the_order_and_merge_kernel_intervals():
    """benchmarks/rounds.py: round r starts with variant r mod V; overlapping kernels count once."""
    from rounds import Variant, busy_ms, run_rounds

    assert busy_ms([(0, 4), (2, 6), (10, 11), (3, 5)]) == 7
    assert busy_ms([]) == 0
    calls = []
    variants = [Variant(n, lambda i, n=n: calls.append(n)) for n in "abc"]
    result = run_rounds(variants, rounds=3, steps=1, warmup=1, cuda=False, log=lambda _: None)
    assert calls[3:] == list("abcbcacab")  # (after one warm-up step each)
    assert all(r["rounds"] == 3 for r in result.values())


def test_fp8_linear_train_smoke_rounds_mode(tmp_path):
    """--smoke --rounds: the methods timed interleaved; speedups paired per round."""
    out = tmp_path / "fp8.json"
    _run(
        "benchmarks/fp8_linear_train.py",
        "--smoke",
        "--rounds",
        "2",
        "--methods",
        "bf16,coatstate",
        "--out",
        str(out),
    )
    data = json.loads(out.read_text())
    assert data["method"] == "rounds" and set(data["results"]) == {"bf16", "coatstate"}
    assert data["summary"]["bf16"]["speedup_vs_bf16"] == 1.0
    spread = data["summary"]["coatstate"]["speedup_vs_bf16_spread"]
    assert (
        spread["n"] == 2 and spread["min"] <= data["summary"]["coatstate"]["speedup_vs_bf16"] <= spread["max"]
    )
    assert data["results"]["coatstate"]["activations"]["kept"] > 0  # the hooks ran


def test_optimizer_step_smoke_interleaves_rounds_and_pairs_with_torch(tmp_path):
    """--device cpu: every optimizer built at once, timed in rounds, ratios paired to torch's AdamW."""
    out = tmp_path / "opt.json"
    _run("benchmarks/optimizer_step.py", "--device", "cpu", "--scale", "0.0001", "--which", "torch,coat",
         "--dtypes", "float32", "--rounds", "2", "--steps", "1", "--burst", "2", "--warmup", "0",
         "--out", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    assert data["meta"]["method"] == "rounds" and not data["meta"]["errors"]
    rows = {r["name"]: r for r in data["rows"]}
    assert len(rows) == 3 and rows["torch AdamW fused (fp32 states)"]["vs_torch"] is None
    for name, r in rows.items():
        assert r["step_ms_spread"]["n"] == 2 and r["floor_ms"] > 0
        if name.startswith("coatstate"):
            assert r["vs_torch"]["n"] == 2 and r["state_bytes_per_param"] < 2.2 and r["nonfinite_params"] == 0


def test_gpu_parity_smoke_runs_on_cpu_and_resumes_exactly(tmp_path):
    """benchmarks/parity_gpu.py --smoke: every variant at a tiny size, one run cut and resumed by a
    second process (it exits nonzero when a resumed curve differs from the uninterrupted one)."""
    out = _run(
        "benchmarks/parity_gpu.py",
        "--smoke",
        "--out",
        str(tmp_path / "parity.json"),
        "--png",
        "",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    )
    assert "smoke: all checks passed" in out


def test_checkpoint_scale_smoke_writes_every_variant(tmp_path):
    """benchmarks/experiments/checkpoint_scale.py --smoke (kept: it drives the per-rank save end to
    end): per-rank saves (blocking, async), DCP async_save, the disk floor and loads, at 1 and 2
    gloo ranks, over 3 rounds."""
    out = tmp_path / "scale.json"
    _run("benchmarks/experiments/checkpoint_scale.py", "--smoke", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["world_size"], r["variant"]) for r in rows} == {
        (w, v) for w in (1, 2) for v in ("blocking", "async", "dcp_async", "floor", "floor_mem", "load")
    }
    for r in rows:
        assert len(r["total_s"]["all"]) == 3 and r["blocked_s"]["median"] <= r["total_s"]["median"], r


def _benchmark_imports() -> list[tuple[str, str, str]]:
    """(script, benchmark module, name) of every `from <benchmark module> import <name>`, in
    benchmarks/ and benchmarks/experiments/."""
    import ast

    scripts = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks/experiments").glob("*.py")])
    modules = {p.stem for p in scripts}
    found = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found += [(path.name, node.module, alias.name) for alias in node.names]
    return found


def test_benchmarks_share_helpers_through_public_names():
    """checkpoint_load imported checkpoint_scale's _optimizer, _cell and _stats, table7 fsdp_train's
    _batch, _log and _setup: what scripts share lives in benchmarks/common.py under public names."""
    private = [
        f"{s}: from {m} import {n}"
        for s, m, n in _benchmark_imports()
        if n.startswith("_") and not (s.startswith("report") and m == "report_common")
    ]  # (report.py uses report_common.py's helpers: the report's own files)
    assert not private, private


def test_experiments_import_only_modules_that_exist():
    """A moved experiment still finds what it imports: a file in benchmarks/, benchmarks/experiments/
    or examples/, an installed package, or an optional peer the script checks for."""
    import ast
    import importlib.util

    optional = {"flashoptim", "torchao", "matplotlib", "zstandard", "numpy"}

    dirs = ("benchmarks", "benchmarks/experiments", "examples")
    here = {p.stem for d in dirs for p in (ROOT / d).glob("*.py")}
    for path in (ROOT / "benchmarks" / "experiments").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for top in {name.split(".")[0] for name in names} - here - optional:
                assert importlib.util.find_spec(top), f"{path.name} imports {top}, which is nowhere"


def test_result_meta_is_the_one_json_header():
    import argparse

    from common import result_meta

    meta = result_meta(argparse.Namespace(device="cpu", out=Path("/tmp/x.json"), sizes=(1, 2)))
    assert {"date", "machine", "device", "torch", "python", "command", "args"} <= set(meta)
    assert meta["args"] == {"device": "cpu", "out": "/tmp/x.json", "sizes": [1, 2]}
    assert json.loads(json.dumps(meta)) == meta
    assert "CPU cores" in meta["machine"] and result_meta()["device"] == "cpu" and "args" not in result_meta()
    # the CPU and checkpoint benchmarks write their header with it
    users = {s for s, m, n in _benchmark_imports() if m == "common" and n == "result_meta"}
    assert {"checkpoint_scale.py", "checkpoint_load.py", "optimizer_cpu.py", "training_parity.py"} <= users


@pytest.mark.slow
def test_one_gpu_smoke_runs_every_setup_and_its_out_of_memory_recovery(tmp_path):
    """benchmarks/one_gpu.py --smoke: each setup in its own process at 2 layers x 64 on the CPU,
    batch 1 timed, then a batch-2 probe that 'runs out of memory' (simulated: no OOM on a CPU),
    recovered from (gradient release included), and the planner's peak beside every batch."""
    out = tmp_path / "one_gpu.json"
    stdout = _run("benchmarks/one_gpu.py", "--smoke", "--out", str(out))
    data = json.loads(out.read_text())
    assert {"date", "machine", "torch", "command"} <= set(data["meta"]) and data["meta"]["smoke"]
    entry = data["models"]["smoke"]
    assert list(entry["setups"]) == ["bf16", "coatstate", "release", "4bit"]
    planned = [r["variant"] for r in entry["plan"]["rows"]]
    assert planned == ["torch AdamW + BF16", "coatstate", "release", "4bit"]
    for name, r in entry["setups"].items():
        assert r["status"] == "ok", (name, r["status"])
        b1 = r["batch1"]
        assert b1["finite"] and len(b1["tokens_per_s"]["all"]) == 3 and b1["predicted"]["peak"] > 0
        assert b1["tokens_per_s"]["min"] <= b1["tokens_per_s"]["median"] <= b1["tokens_per_s"]["max"]
        assert r["probes"] == [{"batch": 2, "fits": False, "oom_phase": r["probes"][0]["oom_phase"]}]
        assert "simulated out of memory" in r["probes"][0]["oom_phase"]
        assert r["search"]["largest"] == r["largest"]["batch"] == 1
        assert not r["search"]["cut_short_by_budget"]
    states = {n: r["batch1"] for n, r in entry["setups"].items()}
    # the fp32 masters are 4 bytes a bf16 weight, the 24-bit correction 1; 4-bit moments are smaller
    assert states["bf16"]["master_bytes"] > 3 * states["coatstate"]["master_bytes"]
    assert states["release"]["moment_bytes"] == states["coatstate"]["moment_bytes"]
    assert states["4bit"]["moment_bytes"] < states["release"]["moment_bytes"]
    assert "peak GB, batch 1 (planner, error)" in stdout and "wrote" in stdout
    from report import section_one_gpu  # docs/benchmarks.md's section reads the same JSON

    assert section_one_gpu(data, out).count("\n| ") == 1 + 4  # the header and a row per setup


def test_one_gpu_records_the_phase_of_an_out_of_memory_error_at_batch_1(tmp_path):
    """A setup that runs out of memory at batch 1 says in which phase, and measures nothing else."""
    out = tmp_path / "part.json"
    cfg = '{"vocab": 256, "dim": 64, "layers": 1, "heads": 4, "hidden": 176, "seq": 32, "loss_chunks": 1}'
    args = ["--setup", "bf16", "--config", cfg, "--out", str(out), "--device", "cpu"]
    _run("benchmarks/one_gpu_child.py", *args, "--simulate-oom-above", "0")
    res = json.loads(out.read_text())
    assert res["oom"]["batch"] == 1 and res["oom"]["phase"] == "forward"
    assert "batch1" not in res and "probes" not in res


def test_one_gpu_batch_search_starts_at_the_guess_and_steps_by_one():
    from one_gpu_child import search

    def fits_below(n):
        tried = []
        return tried, lambda b: tried.append(b) or b < n

    tried, fits = fits_below(5)  # largest fitting: 4
    assert search(fits, 1, 3, 16, lambda: True) == (4, [(3, True), (4, True), (5, False)], False)
    assert tried == [3, 4, 5]
    tried, fits = fits_below(3)
    assert search(fits, 1, 4, 16, lambda: True) == (2, [(4, False), (3, False), (2, True)], False)
    tried, fits = fits_below(100)
    assert search(fits, 1, 15, 16, lambda: True) == (16, [(15, True), (16, True)], False)  # the limit
    assert search(fits, 1, 4, 16, lambda: False) == (1, [], True)  # no time: batch 1 stands


@pytest.mark.slow
def test_optimizers_cpu_train_smoke_pairs_each_optimizer_with_its_reference(tmp_path):
    out = tmp_path / "o.json"
    args = [
        "--steps",
        "2",
        "--seeds",
        "2",
        "--dim",
        "64",
        "--val-tokens",
        "2048",
        "--out",
        str(out),
    ]  # width 64: the matrices reach min_numel
    args += ["--cache-dir", str(tmp_path / "corpus")]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "optimizers_cpu_train.py"), *args], check=True)
    data = json.loads(out.read_text())
    assert [r["optimizer"] for r in data["summary"]] == ["sgd", "lion", "muon"]
    assert all(r["ref_bytes_per_param"] == 4.0 and r["ours_bytes_per_param"] < 1.2 for r in data["summary"])
    assert len(data["runs"]) == 12


def test_offload_smoke_writes_json_with_the_common_header(tmp_path):
    out = tmp_path / "offload.json"
    stdout = _run("benchmarks/offload.py", "--smoke", "--rounds", "2", "--steps", "1", "--out", str(out))
    data = json.loads(out.read_text())
    assert {"date", "machine", "torch", "command"} <= set(data["meta"]) and data["meta"]["smoke"]
    assert data["setups"]["coatstate"]["status"] == "ok"
    assert data["setups"]["torchao"]["status"] == "skipped" and "wrote" in stdout
