"""`coatstate inspect` and `coatstate convert`: outputs, round trips, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import fsspec
import pytest
import torch
from coatstate.formats import GroupQuantized, error_bound

import coatstate
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


def test_convert_expands_as_compressed_adamw_does_unless_told(adamw_pt, tmp_path):
    """Without --expand / --no-expand, convert writes the optimizer's default format (expansion on)."""
    pt, _, _ = adamw_pt
    for flags, expand in (([], True), (["--no-expand"], False), (["--expand"], True)):
        st = str(tmp_path / f"o{len(flags)}{expand}.safetensors")
        assert main(["convert", pt, st, *flags]) == 0
        formats = ck.read_header(st)["params"]["0"]["compressed"]
        assert {f["expand"] for f in formats.values()} == {expand}, (flags, formats)


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
    assert "no checkpoint at" in err and "too short" in err and "without .metadata" in err


def test_python_dash_m_entry_point(adamw_pt):
    pt, _, _ = adamw_pt
    done = subprocess.run([sys.executable, "-m", "coatstate", "inspect", pt], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "fp32" in done.stdout


# ----------------------------------------------------------------- convert never breaks its input
def _trained_compressed():
    from coatstate.optim import CompressedAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    return model, opt


def _directory(kind: str, tmp_path) -> str:
    return str(tmp_path) if kind == "local" else f"memory://coatstate-cli/{uuid.uuid4().hex}"


def _contents(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_convert_refuses_a_file_its_source_reads(kind, tmp_path, capsys):
    """(A per-rank checkpoint is a DCP directory: the DCP rules of refuse_input_as_output.)"""
    model, opt = _trained_compressed()
    root = f"{_directory(kind, tmp_path)}/ckpt.safetensors"
    ck.save(opt, root, model=model, shard_size=2048)
    names = [s["file"] for s in ck.read_header(root)["shards"]]
    files = [root] + [root.rsplit("/", 1)[0] + "/" + n for n in names]
    before = {f: _contents(f) for f in files}
    capsys.readouterr()
    for dst in files[1:]:
        if kind == "local":
            dst = "file://" + dst  # another spelling of the same file
        for force in ([], ["--force"]):  # --force never makes an input writable
            assert main(["convert", root, dst, "--to", "adamw", *force]) == 2, dst
            err = capsys.readouterr().err
            assert "is a shard of SRC" in err and "never overwrites its input" in err, err
            assert err.count("\n") == 1
    assert {f: _contents(f) for f in files} == before
    ck.read_state_dict(root)  # still whole


@pytest.mark.parametrize("spelling", ["plain", "file", "dotdot", "symlink", "memory"])
def test_convert_refuses_its_source_under_another_name(spelling, adamw_pt, tmp_path, capsys):
    pt, _, _ = adamw_pt
    if spelling == "memory":
        pt = f"memory://coatstate-cli/{uuid.uuid4().hex}/optimizer.pt"
        with fsspec.open(pt, "wb") as f:
            f.write((tmp_path / "optimizer.pt").read_bytes())
        dst = pt.replace("memory://", "memory:///")
    else:
        dst = {
            "plain": pt,
            "file": "file://" + pt,
            "dotdot": str(tmp_path / ".." / tmp_path.name / "optimizer.pt"),
            "symlink": str(tmp_path / "link.pt"),
        }[spelling]
        os.symlink(pt, tmp_path / "link.pt")
    before = _contents(pt)
    capsys.readouterr()
    assert main(["convert", pt, dst, "--to", "compressed", "--force"]) == 2
    assert "is the same file as SRC" in capsys.readouterr().err
    assert _contents(pt) == before


def test_convert_replaces_an_existing_dst_only_with_force(adamw_pt, tmp_path, capsys):
    pt, _, _ = adamw_pt
    st = str(tmp_path / "optim.safetensors")
    assert main(["convert", pt, st]) == 0
    first = _contents(st)
    capsys.readouterr()
    assert main(["convert", pt, st, "--group-size", "64"]) == 2
    err = capsys.readouterr().err
    assert st in err and "--force" in err and err.count("\n") == 1
    assert _contents(st) == first
    assert main(["convert", pt, st, "--group-size", "64", "--force"]) == 0
    assert ck.read_header(st)["params"]["0"]["compressed"]["exp_avg"]["group_size"] == 64


def test_convert_into_a_new_file_of_a_dcp_directory_is_allowed_an_existing_one_is_not(tmp_path, capsys):
    (tmp_path / "old.safetensors").write_bytes(b"x")
    assert main(["convert", str(tmp_path), str(tmp_path / "old.safetensors"), "--force"]) == 2
    assert "inside SRC's torch.distributed.checkpoint directory" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "new.safetensors")]) == 1  # (no .metadata)
    assert "usage error" not in capsys.readouterr().err


# ---------------------------------------------------------------- numbers are checked before reading
@pytest.mark.parametrize(
    "option, value",
    [
        ("--group-size", "1000000000000"),
        ("--group-size", str(2**63)),
        ("--group-size", "0"),
        ("--group-size", "65537"),
        ("--min-numel", str(2**63)),
        ("--min-numel", "-1"),
    ],
)
def test_convert_numbers_out_of_range_are_usage_errors_before_reading(option, value, tmp_path, capsys):
    missing = str(tmp_path / "missing.pt")  # never opened: the check comes first
    assert main(["convert", missing, str(tmp_path / "o.safetensors"), option, value]) == 2
    err = capsys.readouterr().err
    assert option in err and "must be an integer from" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "option, value",
    [
        ("--batch", "0"),
        ("--seq", "0"),
        ("--seq", str(2**63)),
        ("--gpus", "0"),
        ("--heads", "0"),
        ("--kv-heads", "-1"),
        ("--ffn", "0"),
        ("--vocab", "0"),
        ("--layers", "-2"),
        ("--layers", "1000000"),
        ("--hidden", str(2**40)),
        ("--loss-chunks", "0"),
        ("--params", "0"),
        ("--params", "1e400"),
        ("--gpu-memory", "0"),
        ("--gpu-memory", "1e400GB"),
    ],
)
def test_plan_numbers_out_of_range_are_usage_errors(option, value, capsys):
    argv = ["plan", "--layers", "2", "--hidden", "64", "--vocab", "128", option, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------ what the CLI says
def test_version_prints_the_version(capsys):
    import coatstate

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"coatstate {coatstate.__version__}\n"


def test_inspect_says_why_a_pt_has_no_checksums(adamw_pt, capsys):
    pt, _, _ = adamw_pt
    assert main(["inspect", pt, "--verify"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("checksums:"))
    assert "holds no checksums" in line and "not verified" not in line
    assert main(["inspect", pt, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checksums_verified"] is False and "holds no checksums" in report["checksums"]


@pytest.mark.parametrize("command", ["inspect", "convert", "plan"])
def test_each_help_says_what_the_command_prints(command, capsys):
    assert main([command, "--help"]) == 0
    description = capsys.readouterr().out.split("positional arguments")[0]
    assert "rints" in description, description  # "Prints ..." / "prints ..."


@pytest.mark.parametrize(
    "flags",
    [["--no-expand"], ["--exp-avg-format", "e2m1", "--exp-avg-sq-format", "ue3m1_sqrt"]],
    ids=["fp8-plain", "4-bit"],
)
def test_convert_between_compressed_formats_keeps_the_master_weights(tmp_path, flags):
    """Re-encoding the moments (FP8 -> plain FP8, FP8 -> 4-bit) goes through torch AdamW's layout,
    which has no master: the 24-bit master of a bf16 model used to be dropped, silently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    model = model.to(torch.bfloat16)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 256, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    src, dst = str(tmp_path / "src.safetensors"), str(tmp_path / "dst.safetensors")
    coatstate.save(opt, src, model=model)
    assert main(["convert", src, dst, "--to", "compressed", *flags]) == 0
    before, after = ck.read(src).optimizer, ck.read(dst).optimizer
    assert [g["master_bits"] for g in after["param_groups"]] == [24]
    for pid, state in before["state"].items():
        assert torch.equal(after["state"][pid]["master_correction"], state["master_correction"])


# ---------------------------------- checkpoint defects of issues 48 and 49, as the CLI meets them
def _defect_state(value: float, shape=(4, 4)) -> dict:
    t = torch.full(shape, value)
    return {
        "state": {0: {"step": torch.tensor(value), "exp_avg": t, "exp_avg_sq": t}},
        "param_groups": [{"params": [0], "lr": 1e-3}],
    }


def _defect_trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    return model, opt


def test_12_inspect_escapes_control_characters_from_the_header(tmp_path, capsys):
    path = tmp_path / "n.safetensors"
    fake = "w\nchecksums: all verified\n\x1b[8m"
    ck.save(_defect_state(1.0), str(path), param_names=[fake])
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    lines = [line for line in out.splitlines() if line.startswith("checksums:")]
    assert lines == ["checksums: not verified (--verify reads and checks every tensor)"], out
    assert "w\\nchecksums: all verified\\n\\x1b[8m" in out


def test_a_inspect_refuses_a_truncated_file_without_verify(tmp_path, capsys):
    path = tmp_path / "t.safetensors"
    ck.save(_defect_state(1.0, shape=(64, 64)), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "truncated" in err, err


def test_a_inspect_refuses_a_truncated_shard(tmp_path, capsys):
    url = str(tmp_path / "s.safetensors")
    ck.save(_defect_state(1.0, shape=(64, 64)), url, shard_size=20_000)
    shard = tmp_path / ck.read_header(url)["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["inspect", url]) == 1
    assert "truncated" in capsys.readouterr().err


def test_c_inspect_names_the_extra_keys(tmp_path, capsys):
    url = str(tmp_path / "e.safetensors")
    ck.save(_defect_state(1.0), url, extra={"step": 3, "rng": torch.get_rng_state()})
    assert main(["inspect", url]) == 0
    assert "extra (the run's other state): rng, step" in capsys.readouterr().out


def test_d_convert_finds_the_optimizer_inside_a_training_checkpoint(tmp_path, capsys):
    model, opt = _defect_trained()
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}, src)
    dst = str(tmp_path / "c.safetensors")
    assert main(["convert", str(src), dst, "--min-numel", "1"]) == 0, capsys.readouterr().err
    got = ck.read(dst)
    assert got.header["params"]["0"]["compressed"] and set(got.model) == set(model.state_dict())


def test_d_convert_takes_key_and_lists_the_keys_it_saw(tmp_path, capsys):
    _, opt = _defect_trained()
    src = tmp_path / "two.pt"
    torch.save({"opt_g": opt.state_dict(), "opt_d": opt.state_dict(), "step": 2}, src)
    assert main(["convert", str(src), str(tmp_path / "a.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "['opt_d', 'opt_g', 'step']" in err and "--key" in err, err
    assert main(["convert", str(src), str(tmp_path / "b.safetensors"), "--key", "opt_d"]) == 0
    assert main(["convert", str(src), str(tmp_path / "c.safetensors"), "--key", "nope"]) == 1
    assert "has no entry 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("key, value", [("n_layer", 10**8), ("n_embd", 2**20), ("vocab_size", 2**30)])
def test_17_a_config_gets_the_bounds_of_the_options(tmp_path, capsys, monkeypatch, key, value):
    from coatstate import planner

    def build(*args, **kwargs):
        raise AssertionError("the model was built: the config's numbers were not bounded")

    monkeypatch.setattr(planner, "resolve_model", build)
    config = {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100, "n_positions": 128, key: value}
    (tmp_path / "huge.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path / "huge.json")]) == 1
    err = capsys.readouterr().err
    assert f"{key}={value:,} is outside" in err, err


def test_18_inspect_refuses_a_shard_symlink_out_of_the_directory_as_read_does(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    (tmp_path / "elsewhere").mkdir()
    url = str(tmp_path / "ck" / "s.safetensors")
    ck.save(_defect_state(1.0, shape=(64, 64)), url, shard_size=20_000)
    for shard in ck.read_header(url)["shards"]:
        inside, outside = tmp_path / "ck" / shard["file"], tmp_path / "elsewhere" / shard["file"]
        os.rename(inside, outside)
        os.symlink(outside, inside)
    with pytest.raises(ck.CheckpointError, match="outside the checkpoint's directory"):
        ck.read(url)
    assert main(["inspect", url]) == 1
    assert "outside the checkpoint's directory" in capsys.readouterr().err


def test_19_a_newline_in_a_path_keeps_the_cli_error_on_one_line(tmp_path, capsys):
    path = tmp_path / "bad\nname.safetensors"
    path.write_bytes(b"not a checkpoint at all")
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad\\nname" in err, err
