"""4-bit moments in checkpoints: saved and resumed bit for bit, hostile headers refused with a
CheckpointError that names the problem, `coatstate convert` into and out of the 4-bit formats,
`inspect` naming them, and a 4-bit checkpoint decompressed into torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch
from coatstate.formats.schema import CheckpointError

from coatstate import CompressedAdamW
from coatstate import checkpoint as ck
from coatstate.cli import main as cli
from tests.checkpoint.files import with_header

FOUR_BIT = dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 128), torch.nn.GELU(), torch.nn.Linear(128, 33))


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 33, generator=g)
        opt.zero_grad()
        (model(x) - x).square().mean().backward()
        opt.step()


def _bits(sd):
    return {
        pid: {
            k: (v.dtype, v.shape, v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            for k, v in s.items()
        }
        for pid, s in sd["state"].items()
    }


@pytest.fixture
def saved(tmp_path):
    model = _model()
    opt = CompressedAdamW(model.parameters(), lr=1e-2, amsgrad=True, **FOUR_BIT)
    _train(model, opt, 3, seed=1)
    path = tmp_path / "four.safetensors"
    ck.save(opt, str(path), model=model)
    return path, model, opt


def test_4bit_state_saves_and_resumes_bit_for_bit(saved):
    path, model, opt = saved
    other = _model(seed=5)
    opt2 = CompressedAdamW(other.parameters(), lr=1e-2, amsgrad=True, **FOUR_BIT)
    _train(other, opt2, 1, seed=9)  # state of its own, replaced by the load
    ck.load(opt2, str(path), model=other)
    assert _bits(opt2.state_dict()) == _bits(opt.state_dict())
    assert opt2.state[other[0].weight]["exp_avg_codes"].shape == (128, 17)  # 33 columns: 17 bytes
    _train(model, opt, 2, seed=3)
    _train(other, opt2, 2, seed=3)
    assert _bits(opt2.state_dict()) == _bits(opt.state_dict())
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    header = ck.read_header(str(path))
    assert header["params"]["0"]["compressed"]["exp_avg"] == {
        "format": "e2m1",
        "group_size": 128,
        "expand": False,
    }
    assert header["params"]["0"]["compressed"]["exp_avg_sq"]["format"] == "ue3m1_sqrt"


def test_a_4bit_checkpoint_loads_into_torch_adamw_decompressed(saved):
    path, model, opt = saved
    plain = torch.optim.AdamW(_model().parameters(), lr=1e-2, amsgrad=True)
    ck.load(plain, str(path))
    state = plain.state_dict()["state"][0]
    assert state["exp_avg"].shape == (128, 33) and state["exp_avg"].dtype == torch.float32
    assert (state["exp_avg_sq"] > 0).all(), "ue3m1_sqrt is zero-free in groups that are not all zero"


def _moment(h, m="exp_avg"):
    return h["params"]["0"]["compressed"][m]


EDITS = {
    "e2m1 for exp_avg_sq": (lambda h: _moment(h, "exp_avg_sq").update(format="e2m1"), "not a format for"),
    "ue3m1_sqrt for exp_avg": (lambda h: _moment(h).update(format="ue3m1_sqrt"), "not a format for"),
    "4-bit with expand": (lambda h: _moment(h).update(expand=True), "expand false"),
    "e4m3 on packed codes": (lambda h: _moment(h).update(format="e4m3"), "uint8 but its format is e4m3"),
    "unknown codebook": (lambda h: _moment(h).update(format="e2m1_nz"), "format must be one of"),
    "group format unknown": (lambda h: h["param_groups"][0].update(exp_avg_format="nf4"), "must be one of"),
    "no parameter shape": (lambda h: h["params"]["0"].update(shape=None), "need their parameter's shape"),
    "wrong parameter shape": (lambda h: h["params"]["0"].update(shape=[128, 35]), "packs into"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_hostile_4bit_headers_are_refused(saved, tmp_path, name):
    path, _, _ = saved
    edit, message = EDITS[name]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(with_header(path.read_bytes(), edit))
    with pytest.raises(CheckpointError, match=message):
        ck.read(str(bad))


def _fp8_checkpoint(tmp_path, steps):
    """An FP8 (default formats) checkpoint of _model after `steps` steps: what convert starts from."""
    model = _model()
    opt = CompressedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, steps, seed=1)
    fp8 = tmp_path / "fp8.safetensors"
    ck.save(opt, str(fp8), model=model)
    return fp8


def test_convert_into_and_out_of_4bit(tmp_path, capsys):
    fp8 = _fp8_checkpoint(tmp_path, steps=3)
    four = tmp_path / "four.safetensors"
    argv = ["convert", str(fp8), str(four), "--to", "compressed", "--exp-avg-format", "e2m1"]
    assert cli([*argv, "--exp-avg-sq-format", "ue3m1_sqrt"]) == 0
    header = ck.read_header(str(four))
    assert _moment(header)["format"] == "e2m1" and _moment(header, "exp_avg_sq")["format"] == "ue3m1_sqrt"
    capsys.readouterr()
    assert cli(["inspect", str(four)]) == 0
    out = capsys.readouterr().out
    assert "exp_avg=e2m1/g128" in out and "exp_avg_sq=ue3m1_sqrt/g128" in out, out
    # a 4-bit checkpoint loads into an optimizer built with its formats and trains on
    other = _model(seed=4)
    opt2 = CompressedAdamW(other.parameters(), lr=1e-2, **FOUR_BIT)
    ck.load(opt2, str(four), model=other)
    _train(other, opt2, 1, seed=2)
    # and back to FP8, and to a torch AdamW .pt file
    back = tmp_path / "back.safetensors"
    assert cli(["convert", str(four), str(back), "--to", "compressed"]) == 0
    assert _moment(ck.read_header(str(back)))["format"] == "e4m3"
    pt = tmp_path / "adamw.pt"
    assert cli(["convert", str(four), str(pt)]) == 0
    sd = torch.load(pt, weights_only=True)
    assert sd["state"][0]["exp_avg"].shape == (128, 33)
    assert (sd["state"][0]["exp_avg_sq"] > 0).all()
    wrong = ["convert", str(fp8), str(tmp_path / "x.safetensors"), "--to", "compressed"]
    assert cli([*wrong, "--exp-avg-format", "ue3m1_sqrt"]) == 2  # a usage error: not a choice there


def test_convert_refuses_expand_with_4bit(tmp_path, capsys):
    fp8 = _fp8_checkpoint(tmp_path, steps=1)
    argv = [
        "convert",
        str(fp8),
        str(tmp_path / "x.safetensors"),
        "--to",
        "compressed",
        "--exp-avg-format",
        "e2m1",
    ]
    assert cli([*argv, "--expand"]) == 1
    assert "pass exp_avg_expand=False" in capsys.readouterr().err


def test_a_string_group_size_on_a_4bit_moment_is_refused_not_a_crash(saved, tmp_path):
    path, _, _ = saved
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(with_header(path.read_bytes(), lambda h: _moment(h).update(group_size="128")))
    with pytest.raises(CheckpointError, match="positive int group_size"):
        ck.read(str(bad))
    bad.write_bytes(with_header(path.read_bytes(), lambda h: _group_size(h, 127)))
    with pytest.raises(CheckpointError, match="even group_size"):
        ck.read(str(bad))


def _group_size(h, n):
    h["param_groups"][0]["group_size"] = n
    for p in h["params"].values():
        for m in p.get("compressed", {}).values():
            m["group_size"] = n
