"""CompressedSGD, CompressedLion and CompressedMuon through checkpoints and the CLI: save/load/read
round trips, loads across each compressed optimizer and its reference, `inspect` and `convert`
both ways, the planner's bytes, and hostile edits of the new headers."""

from __future__ import annotations

import json

import pytest
import torch
from coatstate.formats.schema import CheckpointError

from coatstate import CompressedLion, CompressedMuon, CompressedSGD
from coatstate import checkpoint as ck
from coatstate.cli import main
from coatstate.planner.memory import optimizer_bytes
from tests.checkpoint.files import with_header
from tests.optim.test_sgd_lion_muon import Lion

KINDS = {
    "sgd": (
        CompressedSGD,
        lambda p, **kw: torch.optim.SGD(p, foreach=False, **kw),
        dict(lr=0.05, momentum=0.9),
    ),
    "lion": (CompressedLion, Lion, dict(lr=1e-3, weight_decay=0.1)),
    "muon": (CompressedMuon, torch.optim.Muon, dict(lr=0.02)),
}
SHAPES = [(64, 96), (96, 130), (48, 96)]  # each >= min_numel=4096: compressed


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _train(opt, params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _copy(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("name", KINDS)
def test_save_load_resumes_bit_for_bit(name, fmt, tmp_path):
    cls, _, kw = KINDS[name]
    option = {("exp_avg_format" if name == "lion" else "momentum_format"): fmt}
    a = _params()
    opt = cls(a, **option, **kw)
    _train(opt, a, 2)
    url = str(tmp_path / "o.safetensors")
    ck.save(opt, url)
    header = ck.read_header(url)
    assert header["optimizer"] == {"class": cls.__name__, "variant": "compressed"}
    moment = cls.MOMENTS[0]
    assert header["params"]["0"]["compressed"][moment]["format"] == fmt
    b = _copy(a)
    again = cls(b, **option, **kw)
    ck.load(again, url)
    _train(opt, a, 2, seed=4)
    _train(again, b, 2, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert ck.read(url).optimizer["param_groups"][0]["lr"] == kw["lr"]


@pytest.mark.parametrize("name", KINDS)
def test_load_crosses_between_compressed_and_reference(name, tmp_path):
    """A reference's checkpoint loads into the compressed class (compressed on load), and the
    compressed one into the reference (decompressed), with its hyperparameters."""
    cls, ref_cls, kw = KINDS[name]
    a = _params()
    ref = ref_cls(a, **kw)
    _train(ref, a, 2)
    url = str(tmp_path / "ref.safetensors")
    ck.save(ref, url)
    ours = cls(_copy(a), **kw)
    ck.load(ours, url)
    moment = cls.MOMENTS[0]
    assert moment + "_codes" in ours.state[ours.param_groups[0]["params"][0]]
    url2 = str(tmp_path / "ours.safetensors")
    ck.save(ours, url2)
    back = ref_cls(_copy(a), **kw)
    ck.load(back, url2)
    want, got = ref.state[a[0]][moment], back.state[back.param_groups[0]["params"][0]][moment]
    assert got.dtype == torch.float32 and ((got - want).norm() / want.norm()).item() < 0.05


def test_another_kinds_checkpoint_is_refused(tmp_path):
    a = _params()
    sgd = CompressedSGD(a, momentum=0.9)
    _train(sgd, a, 1)
    url = str(tmp_path / "sgd.safetensors")
    ck.save(sgd, url)
    for other in (CompressedMuon(_copy(a)), torch.optim.AdamW(_copy(a))):
        with pytest.raises(CheckpointError, match="CompressedSGD or SGD"):
            ck.load(other, url)


@pytest.mark.parametrize("name", KINDS)
def test_inspect_shows_the_hyperparameters_and_convert_goes_both_ways(name, tmp_path, capsys):
    cls, ref_cls, kw = KINDS[name]
    a = _params()
    ref = ref_cls(a, **kw)
    _train(ref, a, 2)
    pt, st, back = (str(tmp_path / f) for f in ("ref.pt", "c.safetensors", "back.pt"))
    torch.save(ref.state_dict(), pt)
    # (FP8: a .pt's 4-bit conversion needs the parameters' shapes, which a bare state dict lacks)
    assert main(["convert", pt, st, "--momentum-format", "e5m2", "--exp-avg-format", "e5m2"]) == 0
    capsys.readouterr()
    assert main(["inspect", st]) == 0
    out = capsys.readouterr().out
    assert "=e5m2" in out and f"lr={kw['lr']}" in out
    assert (
        ("momentum=0.9" in out)
        if name == "sgd"
        else ("ns_steps=5" in out if name == "muon" else "betas" in out)
    )
    assert main(["inspect", st, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["state_bytes_per_param"] < 1.1
    assert main(["convert", st, back, "--to", "reference"]) == 0
    loaded = ref_cls(_copy(a), **kw)
    loaded.load_state_dict(torch.load(back, weights_only=True))
    moment = cls.MOMENTS[0]
    want, got = ref.state[a[0]][moment], loaded.state[loaded.param_groups[0]["params"][0]][moment]
    assert ((got - want).norm() / want.norm()).item() < 0.1  # e5m2 codes: the format's error


def test_the_planner_knows_each_optimizers_state_bytes():
    shapes = [(4096, 4096), (4096,)]
    n = sum(torch.Size(s).numel() for s in shapes)
    assert optimizer_bytes(shapes, "sgd") == 4 * n and optimizer_bytes(shapes, "adamw") == 8 * n
    for name in ("compressed_sgd", "compressed_muon", "compressed_lion"):
        fp8 = optimizer_bytes(shapes, name) / n
        four = (
            optimizer_bytes(shapes, name, options={"momentum_format": "e2m1", "exp_avg_format": "e2m1"}) / n
        )
        assert fp8 <= 1.1 and four <= 0.6, (name, fp8, four)
    p = [torch.nn.Parameter(torch.randn(512, 1024))]
    opt = CompressedMuon(p)
    _train(opt, p, 1)
    assert opt.state_bytes() == optimizer_bytes([(512, 1024)], "compressed_muon")


def _edit_group(**values):
    def edit(h):
        h["param_groups"][0].update(values)

    return {"edit": edit}


def _edit_compressed(fmt):
    def edit(h):
        h["params"]["0"]["compressed"]["momentum_buffer"]["format"] = fmt

    return {"edit": edit}


HOSTILE = {
    "negative momentum": _edit_group(momentum=-0.5),
    "nesterov a string": _edit_group(nesterov="yes"),
    "dampening a string": _edit_group(dampening="0"),
    "lr a list": _edit_group(lr=[0.1]),
    "momentum_format unknown": _edit_group(momentum_format="e9m9"),
    "momentum_expand a string": _edit_group(momentum_expand="true"),
    "a second-moment format for the momentum": _edit_compressed("ue3m1_sqrt"),
    "class renamed to another kind": {"edit": lambda h: h["optimizer"].update({"class": "CompressedMuon"})},
}
MUON_HOSTILE = {
    "ns_steps 1000": _edit_group(ns_steps=1000),
    "ns_coefficients two": _edit_group(ns_coefficients={"$tuple": [1.0, 2.0]}),
    "adjust_lr_fn unknown": _edit_group(adjust_lr_fn="cubic"),
}


@pytest.fixture(scope="module")
def saved_files(tmp_path_factory):
    out = {}
    for name in ("sgd", "muon"):
        cls, _, kw = KINDS[name]
        a = _params()
        opt = cls(a, **kw)
        _train(opt, a, 1)
        url = tmp_path_factory.mktemp(name) / "o.safetensors"
        ck.save(opt, str(url))
        out[name] = (url.read_bytes(), cls, kw)
    return out


@pytest.mark.parametrize("edit", [*HOSTILE, *MUON_HOSTILE])
def test_hostile_edits_of_the_new_headers_are_refused(edit, saved_files, tmp_path):
    data, cls, kw = saved_files["muon" if edit in MUON_HOSTILE else "sgd"]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(with_header(data, **{**HOSTILE, **MUON_HOSTILE}[edit]))
    target = cls(_params(3), **kw)
    before = {
        k: v.clone() for k, v in target.state_dict()["param_groups"][0].items() if isinstance(v, torch.Tensor)
    }
    with pytest.raises(CheckpointError) as info:
        ck.load(target, str(bad))
    assert str(bad) in str(info.value)
    assert target.state == {} and not before
    if edit != "class renamed to another kind":  # (a valid file of another class: only loading it is wrong)
        with pytest.raises(CheckpointError):
            ck.read(str(bad))
