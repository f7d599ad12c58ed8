"""Checkpoint defects found by attacking the landed code (issue 48), one test (or a few) each.

Every test here failed before its fix: it names the defect it pins down.
"""

from __future__ import annotations

import errno
import os
import tracemalloc
import uuid
import warnings

import fsspec
import pytest
import torch
from coatstate.formats.schema import CheckpointError

from coatstate.checkpoint import api as ck
from coatstate.checkpoint import encoding
from tests.checkpoint.files import with_header


def _state(value: float, shape=(4, 4)) -> dict:
    t = torch.full(shape, value)
    return {
        "state": {0: {"step": torch.tensor(value), "exp_avg": t, "exp_avg_sq": t}},
        "param_groups": [{"params": [0], "lr": 1e-3}],
    }


def _files(directory: str) -> set[str]:
    """Every file under `directory`, relative to it, listed afresh."""
    fs, path = fsspec.core.url_to_fs(directory)
    fs.invalidate_cache()
    try:
        return {f[len(path.rstrip("/")) + 1 :] for f in fs.find(path)}
    except FileNotFoundError:
        return set()


@pytest.fixture(params=["local", "memory", "s3"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    if request.param == "memory":
        return f"memory://coatstate-defects/{uuid.uuid4().hex}"
    return f"{request.getfixturevalue('s3_bucket')}/{uuid.uuid4().hex}"


# -------------------------------------------------------------- 1: glob characters in URLs
@pytest.mark.parametrize("name", ["run*.safetensors", "run[1].safetensors", "a?b.safetensors"])
def test_1_glob_characters_in_a_name_are_literal(directory, name):
    url = f"{directory}/{name}"
    ck.save(_state(1.0), url)
    ck.save(_state(2.0), url)  # over an existing file: the new step, never the stale one
    assert ck.read(url).optimizer["state"][0]["step"].item() == 2.0
    assert _files(directory) == {name}, "a temp file was left, or the save went elsewhere"


def test_1_a_bracket_in_a_directory_name_is_literal(directory):
    url = f"{directory}/sweep[1]/ck.safetensors"
    ck.save(_state(3.0), url)
    assert ck.read(url).optimizer["state"][0]["step"].item() == 3.0
    assert _files(directory) == {"sweep[1]/ck.safetensors"}


def test_1_a_pattern_name_never_touches_the_files_it_matches(directory):
    ck.save(_state(1.0), f"{directory}/run1.safetensors")
    ck.save(_state(2.0), f"{directory}/run*.safetensors")
    assert ck.read(f"{directory}/run1.safetensors").optimizer["state"][0]["step"].item() == 1.0
    assert ck.read(f"{directory}/run*.safetensors").optimizer["state"][0]["step"].item() == 2.0


# ------------------------------------------------------------- 2: saved but never readable
class _ThreeBetas(torch.optim.Optimizer):
    """An optimizer with three betas (as Adan has): its own hyperparameters, its own class."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3, "betas": (0.98, 0.92, 0.99)})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["m"] = p.detach().clone()


def _stepped(make):
    model = torch.nn.Linear(4, 3)
    opt = make(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("distributed", ["gathered", "per_rank"])
@pytest.mark.parametrize("make", [torch.optim.Adafactor, _ThreeBetas], ids=["adafactor", "three_betas"])
def test_2_what_save_writes_read_and_load_open(make, distributed, tmp_path):
    url = str(tmp_path / "o.safetensors")
    model, opt = _stepped(make)
    ck.save(opt, url, model=model, distributed=distributed)
    got = ck.read(url)
    assert got.optimizer["param_groups"][0] == {k: v for k, v in opt.state_dict()["param_groups"][0].items()}
    fresh = make(model.parameters())
    ck.load(fresh, url, model=model)
    for a, b in zip(fresh.state_dict()["state"].values(), opt.state_dict()["state"].values(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_2_a_state_dict_of_an_unknown_optimizer_saves_and_reads_back(tmp_path):
    """No class recorded: the keys say whose rules apply (formats.optimizer_schema). Adafactor's
    are nobody's, so its eps=(None, 1e-3) is kept as it is, written and read back."""
    url = tmp_path / "sd.safetensors"
    _, opt = _stepped(torch.optim.Adafactor)
    ck.save(opt.state_dict(), url)
    assert ck.read(url).optimizer["param_groups"][0]["eps"] == opt.state_dict()["param_groups"][0]["eps"]


@pytest.mark.parametrize("distributed", ["gathered", "per_rank"])
def test_2_a_state_dict_the_reader_would_refuse_is_refused_before_writing(tmp_path, distributed):
    url = tmp_path / "sd.safetensors"
    _, opt = _stepped(torch.optim.AdamW)
    sd = opt.state_dict()
    sd["param_groups"][0]["eps"] = (None, 1e-3)  # AdamW's keys, so AdamW's rules: eps is a number
    with pytest.raises(CheckpointError, match=r"not saved: a reader would refuse.*eps") as e:
        ck.save(sd, url, distributed=distributed)
    assert str(url) in str(e.value) and "Save the optimizer itself" in str(e.value)
    assert not url.exists()


# ------------------------------------------------------------------- 4: parameter order
class _EncDec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.dec(self.enc(x))


def _trained(make_params):
    torch.manual_seed(0)
    model = _EncDec()
    opt = torch.optim.AdamW(make_params(model), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
    return model, opt


def _moments_by_name(model, opt) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()}


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "named_parameters"])
def test_4_load_matches_parameters_by_name_not_position(tmp_path, with_model):
    url = str(tmp_path / "o.safetensors")
    forward = (lambda m: m.parameters()) if with_model else (lambda m: m.named_parameters())
    backward = (
        (lambda m: list(m.parameters())[::-1]) if with_model else (lambda m: list(m.named_parameters())[::-1])
    )
    model, opt = _trained(forward)
    ck.save(opt, url, model=model)
    model2 = _EncDec()
    opt2 = torch.optim.AdamW(backward(model2), lr=1e-2)
    ck.load(opt2, url, model=model2 if with_model else None)
    want, got = _moments_by_name(model, opt), _moments_by_name(model2, opt2)
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} got another parameter's moments"


def test_4_names_that_differ_are_refused_before_anything_loads(tmp_path):
    url = str(tmp_path / "o.safetensors")
    model, opt = _trained(lambda m: m.parameters())
    ck.save(opt, url, model=model)
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"not the checkpoint's.*only in the file \['enc.weight'"):
        ck.load(opt2, url, model=other)
    assert not opt2.state


# ------------------------------------------------- snag (b): torch.compile's _orig_mod. keys
@pytest.mark.parametrize("compiled_side", ["saved", "loaded"])
def test_b_a_compiled_models_keys_load_both_ways(tmp_path, compiled_side):
    url = str(tmp_path / "o.safetensors")
    model, opt = _trained(lambda m: m.parameters())
    saved_as = torch.compile(model) if compiled_side == "saved" else model  # (never run: no compiler needed)
    ck.save(opt, url, model=saved_as)
    model2 = _EncDec()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ck.load(opt2, url, model=torch.compile(model2) if compiled_side == "loaded" else model2)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    want, got = _moments_by_name(model, opt), _moments_by_name(model2, opt2)
    assert all(torch.equal(want[n], got[n]) for n in want)


# --------------------------------------------------------------------- 5 and 8: zstd bombs
def test_5_load_compares_shapes_before_it_decompresses(tmp_path, monkeypatch):
    pytest.importorskip("zstandard")
    url = str(tmp_path / "bomb.safetensors")
    ck.save(_state(0.0, shape=(2048, 2048)), url, compress="zstd")  # 16 MiB of zeros in a few kB
    assert (tmp_path / "bomb.safetensors").stat().st_size < 64 * 1024

    def decode(*args, **kwargs):
        raise AssertionError("decompressed before the shapes were compared")

    monkeypatch.setattr(encoding, "decode", decode)
    model = torch.nn.Linear(4, 4, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"shape \[4, 4\] in the optimizer but \[2048, 2048\]"):
        ck.load(opt, url)


def test_5_a_zstd_tensor_inflates_into_its_own_memory_once(tmp_path):
    pytest.importorskip("zstandard")
    url = str(tmp_path / "z.safetensors")
    ck.save(_state(0.0, shape=(2048, 4096)), url, compress="zstd")  # 32 MiB a moment
    tracemalloc.start()
    try:
        got = ck.read(url)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.optimizer["state"][0]["exp_avg"].shape == (2048, 4096)
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB of Python buffers for 32 MiB tensors"


def test_8_a_shape_whose_size_overflows_int64_is_a_checkpoint_error(tmp_path):
    pytest.importorskip("zstandard")
    path = tmp_path / "m.safetensors"
    ck.save(_state(1.0), str(path), model={"w": torch.zeros(64, 64)}, compress="zstd")
    huge = [4096, 2**52 + 1]
    path.write_bytes(with_header(path.read_bytes(), lambda h: h["tensors"]["model/w"].update(shape=huge)))
    with pytest.raises(CheckpointError, match="model/w"):
        ck.read(str(path))


# ------------------------------------------------------------- 6: group_size has a ceiling
def test_6_group_size_is_capped_in_the_constructor_groups_and_files(tmp_path):
    from coatstate.optim import CompressedAdamW

    w = torch.nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ValueError, match="group_size"):
        CompressedAdamW([w], group_size=2**40)
    with pytest.raises(ValueError, match="group_size"):
        CompressedAdamW([{"params": [w], "group_size": 2**40}])
    CompressedAdamW([w], group_size=2**16)  # the ceiling itself is allowed
    opt = CompressedAdamW([w], min_numel=1)
    w.grad = torch.randn(64, 64)
    opt.step()
    path = tmp_path / "c.safetensors"
    ck.save(opt, str(path))

    def huge(h):
        h["param_groups"][0]["group_size"] = 2**40
        for m in h["params"]["0"]["compressed"].values():
            m["group_size"] = 2**40
        for part in ("scales", "exponents"):  # one group a row: the scales agree with it
            for m in ("exp_avg", "exp_avg_sq"):
                key = f"state/0/{m}_{part}"
                if key in h["tensors"]:
                    h["tensors"][key]["shape"] = [64, 1]

    path.write_bytes(with_header(path.read_bytes(), huge))
    with pytest.raises(CheckpointError, match=r"group_size must be an integer from 1 to 65536"):
        ck.read(str(path))


def test_6_one_ceiling_for_the_library_and_the_cli():
    from coatstate.formats.defaults import MAX_GROUP_SIZE

    from coatstate.cli.convert import MAX_GROUP_SIZE as CLI_MAX

    assert CLI_MAX == MAX_GROUP_SIZE == 2**16


# ----------------------------------------------------------- 7: tensor values are checked
def _compressed_state() -> tuple[torch.nn.Module, dict]:
    from coatstate.optim import CompressedAdamW

    model = torch.nn.Linear(64, 64, bias=False)
    opt = CompressedAdamW(model.parameters(), min_numel=1, exp_avg_expand=True, exp_avg_sq_expand=True)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt.state_dict()


def _nan_scale(state):
    state["exp_avg_scales"][0, 0] = float("nan")


def _zero_exponent(state):
    state["exp_avg_sq_exponents"][0, 0] = 0


_BAD_VALUES = {
    "step -5": (lambda s: s.update(step=torch.tensor(-5.0)), "step is -5"),
    "step nan": (lambda s: s.update(step=torch.tensor(float("nan"))), "step is nan"),
    "nan scale": (_nan_scale, "exp_avg_scales holds NaN"),
    "exponent 0": (_zero_exponent, "exp_avg_sq_exponents holds the code 0"),
    "two-element step": (lambda s: s.update(step=torch.tensor([1.0, 2.0])), "one-element"),
}


@pytest.mark.parametrize(
    "bad, container",
    # (a two-element step never reaches a .safetensors file: save refuses its header)
    [(b, c) for b in _BAD_VALUES for c in ("safetensors", "pt") if b != "two-element step" or c == "pt"],
)
def test_7_bad_values_are_refused_before_the_optimizer_changes(tmp_path, bad, container):
    from coatstate.optim import CompressedAdamW

    edit, problem = _BAD_VALUES[bad]
    model, sd = _compressed_state()
    edit(sd["state"][0])
    url = str(tmp_path / f"bad.{container}")
    if container == "pt":
        torch.save(sd, url)
    else:
        ck.save(sd, url)
    opt = CompressedAdamW(model.parameters(), min_numel=1)
    before = opt.state_dict()
    with pytest.raises(CheckpointError, match=problem):
        ck.load(opt, url)
    assert opt.state_dict() == before


# ------------------------------------------------------- 10: no half-loaded model on failure
def _with_expanded_buffer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("b", torch.zeros(1).expand(4))  # one element seen four times
    return model


def test_10_a_model_that_cannot_take_the_load_is_refused_before_anything_loads(tmp_path):
    url = str(tmp_path / "m.safetensors")
    model = _with_expanded_buffer(0)
    opt = torch.optim.AdamW(model.parameters())
    ck.save(opt, url, model=model)
    model2 = _with_expanded_buffer(1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    opt2 = torch.optim.AdamW(model2.parameters())
    with pytest.raises(CheckpointError, match=r"model tensor b is expanded.*nothing was loaded"):
        ck.load(opt2, url, model=model2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was loaded although the load failed"


# ------------------------------------------------------- 12: every header field has its type
def test_12_every_header_field_has_its_type(tmp_path):
    path = tmp_path / "v.safetensors"
    ck.save(_state(1.0), str(path))
    path.write_bytes(with_header(path.read_bytes(), lambda h: h.update(library_version=["0.2", "\x1b[2J"])))
    with pytest.raises(CheckpointError, match="library_version must be a string"):
        ck.read_header(str(path))


# ----------------------------------------------- 13: state dicts keyed by parameter name
def _named_state_dict():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = _trained(lambda m: m.parameters())
    sd = get_optimizer_state_dict(model, opt)
    assert set(sd["state"]) == {"enc.weight", "enc.bias", "dec.weight", "dec.bias"}
    return model, opt, sd


def test_13_save_takes_a_state_dict_keyed_by_name(tmp_path):
    url = str(tmp_path / "n.safetensors")
    model, opt, sd = _named_state_dict()
    ck.save(sd, url)
    assert [ck.read_header(url)["params"][str(i)]["name"] for i in range(4)] == list(sd["state"])
    model2 = _EncDec()
    opt2 = torch.optim.AdamW(list(model2.named_parameters())[::-1], lr=1e-2)  # (matched by name)
    ck.load(opt2, url)
    want, got = _moments_by_name(model, opt), _moments_by_name(model2, opt2)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_13_convert_takes_a_pt_keyed_by_name(tmp_path, capsys):
    from coatstate.cli import main as cli

    _, _, sd = _named_state_dict()
    torch.save(sd, tmp_path / "n.pt")
    assert cli(["convert", str(tmp_path / "n.pt"), str(tmp_path / "n.safetensors"), "--min-numel", "1"]) == 0
    header = ck.read_header(str(tmp_path / "n.safetensors"))
    assert header["params"]["0"]["name"] == "enc.weight" and header["params"]["0"]["compressed"]


# ------------------------------------------------------- 14 and 15: write errors name the path
def _disk_full(monkeypatch):
    from coatstate.checkpoint import storage

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage.os, "fsync", fsync)


def test_14_a_full_disk_names_the_checkpoint_and_what_to_do(tmp_path, monkeypatch):
    url = str(tmp_path / "ck.safetensors")
    _disk_full(monkeypatch)
    with pytest.raises(OSError, match=r"cannot write .*ck\.safetensors: No space left.*free space") as e:
        ck.save(_state(1.0), url)
    assert e.value.errno == errno.ENOSPC and ".tmp-" not in str(e.value)
    assert os.listdir(tmp_path) == []


def test_14_the_cli_blames_dst_for_a_failed_write(tmp_path, monkeypatch, capsys):
    from coatstate.cli import main as cli

    torch.save(_state(1.0), tmp_path / "big.pt")
    _disk_full(monkeypatch)
    assert cli(["convert", str(tmp_path / "big.pt"), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'out.safetensors'}" in err and "big.pt" not in err, err


def test_15_a_255_byte_name_saves_and_reads(tmp_path):
    name = "é" * 60 + "x" * (255 - 120 - len(".safetensors")) + ".safetensors"
    assert len(name.encode()) == 255
    url = str(tmp_path / name)
    ck.save(_state(1.0), url)
    assert ck.read(url).optimizer["state"][0]["step"].item() == 1.0
    assert os.listdir(tmp_path) == [name]


def test_15_a_name_past_name_max_is_reported_by_its_own_name(tmp_path):
    url = str(tmp_path / ("x" * 300 + ".safetensors"))
    with pytest.raises(OSError, match=r"cannot write .*x{300}\.safetensors") as e:
        ck.save(_state(1.0), url)
    assert ".tmp-" not in str(e.value)


# ------------------------------------------------- snag (c): the run's other state, same file
def _run_state(opt) -> dict:
    import random

    multi = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5])  # (a Counter: int keys)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return {
        "step": 100,
        "schedulers": [multi.state_dict(), cosine.state_dict()],
        "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(opt).state_dict(),  # best=inf
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "data": {"epoch": 2, "position": (7, 31), "files": ["a.bin", None], "loss": 2.5},
        "ema": torch.randn(3, 4, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_c_save_extra_round_trips_through_read_load_and_convert(tmp_path, compress):
    url = str(tmp_path / "run.safetensors")
    model, opt = _trained(lambda m: m.parameters())
    extra = _run_state(opt)
    ck.save(opt, url, model=model, extra=extra, compress=compress)
    from coatstate.cli import main as cli

    converted = str(tmp_path / "converted.safetensors")
    assert cli(["convert", url, converted]) == 0
    loaded = ck.load(torch.optim.AdamW(model.parameters()), url, model=model)
    for got in (ck.read(url).extra, loaded.extra, ck.read(converted).extra):
        assert got["step"] == 100 and got["data"] == extra["data"] and got["plateau"] == extra["plateau"]
        assert got["rng"]["python"] == extra["rng"]["python"]
        assert torch.equal(got["rng"]["torch"], extra["rng"]["torch"])
        assert torch.equal(got["ema"], extra["ema"])
        assert got["schedulers"][1] == extra["schedulers"][1]
        assert got["schedulers"][0]["milestones"] == {3: 1, 5: 1}
    resumed = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1])
    resumed.load_state_dict(got["schedulers"][0])
    assert resumed.milestones == {3: 1, 5: 1}
    torch.set_rng_state(got["rng"]["torch"])  # a uint8 tensor torch takes as it is


def test_c_extra_never_takes_what_it_cannot_store(tmp_path):
    with pytest.raises(TypeError, match=r"extra\.callback: cannot store a value of type function"):
        ck.save(_state(1.0), str(tmp_path / "x.safetensors"), extra={"callback": lambda: 0})
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda h: h["extra"].update(x={"$tensor": "state/0/step"}), "extra may name only extra/"),
        (lambda h: h["extra"].update(x={"$tensor": "extra/9"}), "does not list"),
        (lambda h: h["extra"].update(x={"$items": [[[1], 2]]}), r"\$items must hold"),
        (lambda h: h.update(extra=[1]), "extra must be null or an object"),
        (lambda h: h["extra"].pop("t"), "are listed but no"),
    ],
    ids=["a state tensor", "an unlisted tensor", "a list as a key", "a list", "an unnamed tensor"],
)
def test_c_a_hostile_extra_is_refused(tmp_path, edit, problem):
    path = tmp_path / "e.safetensors"
    ck.save(_state(1.0), str(path), extra={"t": torch.ones(2), "n": 1})
    path.write_bytes(with_header(path.read_bytes(), edit))
    with pytest.raises(CheckpointError, match=problem):
        ck.read(str(path))


# ------------------------------------------------------------ 3 and 11: sharded roots
# Fixed by design: a save removes only the shards of the root it replaced and matches no file by
# its name (checkpoint/shards.py).
def test_3_a_renamed_sharded_root_keeps_its_shards_after_the_next_save(tmp_path):
    ckpt, best = tmp_path / "ck.safetensors", tmp_path / "best.safetensors"
    ck.save(_state(1.0, shape=(64, 64)), str(ckpt), shard_size=20_000)
    assert len(ck.read_header(str(ckpt))["shards"]) >= 2
    os.rename(ckpt, best)
    assert ck.read(str(best)).optimizer["state"][0]["step"].item() == 1.0
    ck.save(_state(2.0, shape=(64, 64)), str(ckpt), shard_size=20_000)
    assert ck.read(str(best)).optimizer["state"][0]["step"].item() == 1.0  # its shards are still there


def test_11_a_save_keeps_another_checkpoints_temp_file(tmp_path):
    # the temp file of a save in flight to ck-20240101-00001-of-00001.safetensors, a name that looks
    # like a shard of ck.safetensors
    other = tmp_path / ".ck-20240101-00001-of-00001.safetensors.tmp-0123456789ab"
    other.write_bytes(b"half of another checkpoint")
    ck.save(_state(1.0), str(tmp_path / "ck.safetensors"))
    assert other.exists(), "a save of ck.safetensors removed another save's temp file"


# ------------------------------------------------------- 9: sparse and meta tensors in a .pt
@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
        (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr tensor"),
        (lambda: torch.empty(3, 3, device="meta"), "meta tensor"),
    ],
    ids=["sparse", "csr", "meta"],
)
def test_9_sparse_and_meta_tensors_are_named_not_unexpected(tmp_path, capsys, make, problem):
    from coatstate.cli import main as cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's "sparse CSR support is in beta")
        t = make()
    sd = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": t}}, "param_groups": [{"params": [0]}]}
    pt = str(tmp_path / "s.pt")
    torch.save(sd, pt)
    for argv in (["inspect", pt], ["convert", pt, str(tmp_path / "s.safetensors")]):
        assert cli(argv) == 1
        err = capsys.readouterr().err
        assert "unexpected" not in err and f"state[0].exp_avg is a {problem}" in err, err
    with pytest.raises(TypeError, match=f"state\\[0\\].exp_avg is a {problem}"):
        ck.save(sd, str(tmp_path / "direct.safetensors"))
    with pytest.raises(CheckpointError, match=problem):
        ck.load(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 3))]), pt)


# ------------------------------------------------------------ 19: '..' through nothing
def test_19_a_path_through_a_missing_directory_and_dotdot_makes_nothing(tmp_path):
    url = str(tmp_path / "missing" / ".." / "x.safetensors")
    with pytest.raises(FileNotFoundError, match=r"missing/\.\. does not exist.*without '\.\.'"):
        ck.save(_state(1.0), url)
    assert os.listdir(tmp_path) == []
    (tmp_path / "there").mkdir()
    ck.save(_state(1.0), str(tmp_path / "there" / ".." / "y.safetensors"))  # (there/.. exists)
    assert sorted(os.listdir(tmp_path)) == ["there", "y.safetensors"]


# ------------------------------------------- 16: what compress=False promises, and to whom
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_16_compress_false_is_torch_adamw_exactly_where_the_docstring_says(dtype):
    from coatstate.optim import CompressedAdamW

    assert "exactly as torch.optim.AdamW on float32 parameters" in " ".join(CompressedAdamW.__doc__.split())
    p1 = torch.nn.Parameter(torch.randn(16, 16, dtype=dtype))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = CompressedAdamW([p2], lr=1e-2, weight_decay=0.1, compress=False, master_bits=None)
    theirs = torch.optim.AdamW([p1], lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        g = torch.randn(16, 16, dtype=dtype)
        p1.grad, p2.grad = g.clone(), g.clone()
        theirs.step()
        ours.step()
    assert ours.state[p2]["exp_avg"].dtype == torch.float32  # (the docstring's "float32 moments")
    assert torch.equal(p1, p2) == (dtype == torch.float32)


def test_2_a_value_nested_past_the_readers_depth_is_refused_before_writing(tmp_path):
    url = tmp_path / "deep.safetensors"
    deep: list = []
    for _ in range(70):
        deep = [deep]
    sd = _state(1.0)
    sd["param_groups"][0]["schedule"] = deep  # (the reader refuses JSON deeper than 64 levels)
    with pytest.raises(CheckpointError, match="nested deeper than 64"):
        ck.save(sd, str(url))
    assert not url.exists()


def test_2_a_header_past_the_readers_limit_is_refused_before_writing(tmp_path, monkeypatch):
    from coatstate.formats import schema

    monkeypatch.setattr(schema, "MAX_HEADER_BYTES", 4096)  # (a real one is 100 MiB of JSON)
    url = tmp_path / "big.safetensors"
    with pytest.raises(CheckpointError, match=r"big\.safetensors: .*header would be .* over safetensors"):
        ck.save(_state(1.0), str(url), extra={"notes": "x" * 8192})
    assert os.listdir(tmp_path) == []
