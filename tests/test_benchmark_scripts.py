"""The CPU benchmark scripts still run end to end at tiny sizes (they are not imported by the
library, so nothing else would notice a broken script: one once called a helper whose signature
had changed)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_training_parity_script_writes_json_and_png(tmp_path):
    out, png = tmp_path / "parity.json", tmp_path / "parity.png"
    _run(
        "benchmarks/training_parity.py",
        "--steps",
        "6",
        "--tail",
        "3",
        "--dim",
        "64",
        "--bound",
        "1.0",
        "--out",
        str(out),
        "--plot",
        str(png),
    )
    report = json.loads(out.read_text())
    assert [len(v["losses"]) for v in report["variants"]] == [6] * 5
    assert report["variants"][-1]["reference"] == "CompressedAdamW, blocks compiled"
    try:
        import matplotlib  # noqa: F401  (an optional extra: the script skips the PNG without it)
    except ImportError:
        assert not png.exists()
    else:
        assert png.stat().st_size > 10_000


def test_activation_memory_script_runs_on_cpu(tmp_path):
    out = tmp_path / "act.json"
    _run(
        "benchmarks/activation_memory.py",
        "--device",
        "cpu",
        "--layers",
        "2",
        "--seq",
        "64",
        "--batch",
        "2",
        "--dim",
        "64",
        "--heads",
        "2",
        "--vocab",
        "256",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    )
    rows = json.loads(out.read_text())["rows"]
    assert {r["variant"] for r in rows} >= {"none", "compress_activations"}


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
