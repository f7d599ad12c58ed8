"""`coatstate inspect` and `coatstate convert`: outputs, round trips, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from coatstate.formats import GroupQuantized, error_bound

from coatstate import checkpoint as ck
from coatstate.cli import main


@pytest.fixture
def adamw_pt(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Tanh(), torch.nn.Linear(128, 40))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(16, 96, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    return str(path), opt.state_dict(), model


def test_convert_adamw_to_compressed_and_back_is_within_the_fp8_bound(adamw_pt, tmp_path, capsys):
    pt, original, model = adamw_pt
    st, back = str(tmp_path / "optim.safetensors"), str(tmp_path / "back.pt")
    assert main(["convert", pt, st, "--min-numel", "4096"]) == 0
    assert main(["convert", st, back]) == 0
    assert "compressed" in capsys.readouterr().err

    compressed = ck.read_state_dict(st)
    restored = torch.load(back, weights_only=True)
    checked = 0
    for pid, s in original["state"].items():
        r = restored["state"][pid]
        assert torch.equal(r["step"], s["step"])
        c = compressed["state"][pid]
        for name in ("exp_avg", "exp_avg_sq"):
            if f"{name}_codes" not in c:  # small / 1-D params keep exact fp32 states
                assert torch.equal(r[name], s[name]), (pid, name)
                continue
            q = GroupQuantized(c[f"{name}_codes"], c[f"{name}_scales"], c.get(f"{name}_exponents"), 128)
            excess = ((r[name] - s[name]).abs() - error_bound(q, s[name])).max().item()
            assert excess <= 0, f"param {pid} {name}: error exceeds the bound by {excess}"
            checked += 1
    assert checked == 4  # both weights, both moments

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(restored)  # torch's own AdamW takes it and steps
    model(torch.randn(2, 96)).sum().backward()
    opt.step()
    assert "compress" not in opt.param_groups[0]


def test_convert_options_and_zstd(adamw_pt, tmp_path):
    pt, _, _ = adamw_pt
    st = str(tmp_path / "o.safetensors")
    args = ["convert", pt, st, "--exp-avg-sq-format", "e5m2", "--no-expand", "--group-size", "64", "--zstd"]
    assert main(args) == 0
    header = ck.read_header(st)
    assert header["compression"] == "zstd"
    assert header["params"]["0"]["compressed"]["exp_avg_sq"] == {
        "format": "e5m2",
        "group_size": 64,
        "expand": False,
    }


def test_inspect_reports_formats_sizes_and_step(adamw_pt, tmp_path, capsys):
    pt, _, _ = adamw_pt
    st = str(tmp_path / "o.safetensors")
    assert main(["convert", pt, st, "--expand"]) == 0
    capsys.readouterr()
    assert main(["inspect", st, "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checksums_verified"] is True
    assert report["step"] == 4.0
    assert report["compressed_elements"] == 96 * 128 + 128 * 40
    assert report["full_precision_elements"] == 128 + 40
    assert report["param_groups"][0]["betas"] == [0.9, 0.999]
    assert 2.0 < report["state_bytes_per_param"] < 2.3
    assert report["ratio_vs_fp32_adamw"] < 0.28
    assert main(["inspect", st]) == 0
    text = capsys.readouterr().out
    assert "exp_avg=e4m3+exp/g128" in text and "not verified" in text
    assert main(["inspect", pt]) == 0
    assert "torch.save optimizer state dict" in capsys.readouterr().out


def test_inspect_verify_catches_corruption_with_one_line(adamw_pt, tmp_path, capsys):
    pt, _, _ = adamw_pt
    st = tmp_path / "o.safetensors"
    assert main(["convert", pt, str(st)]) == 0
    data = bytearray(st.read_bytes())
    data[-10] ^= 0x40
    st.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["inspect", str(st)]) == 0  # the header alone is intact
    capsys.readouterr()
    assert main(["inspect", str(st), "--verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coatstate: error: ") and "checksum mismatch" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["inspect"],
        ["convert", "a.pt"],
        ["convert", "a.pt", "b.pt"],
        ["convert", "a.pt", "b.safetensors", "--to", "fp4"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_checkpoint_problems_exit_1(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 1
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 5)
    assert main(["inspect", str(tmp_path / "junk.safetensors")]) == 1
    assert main(["convert", str(tmp_path), str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "too short" in err and "pickle" in err


def test_python_dash_m_entry_point(adamw_pt):
    pt, _, _ = adamw_pt
    done = subprocess.run([sys.executable, "-m", "coatstate", "inspect", pt], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "fp32" in done.stdout
