"""coatstate.save / load / read: round trips, bit-exact resume, atomicity, corruption, interop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import fsspec
import pytest
import torch
from coatstate.formats import schema
from coatstate.formats.schema import CheckpointError
from safetensors import safe_open

from coatstate.checkpoint import api as ck
from coatstate.checkpoint import container, encoding
from coatstate.optim import CompressedAdamW
from tests.conftest import child_env, requires_cuda


def _model(seed: int = 0, hidden: int = 128) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 64*128 = 8192 elements >= min_numel: the weights get FP8 states, the biases fp32 ones
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 64))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _assert_same(a, b, where="state dict") -> None:
    """Exact equality of nested dicts/lists of tensors (dtype, shape and bits) and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a,
            b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b,
        ), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _url(kind: str, tmp_path) -> str:
    if kind == "local":
        return str(tmp_path / "ckpt.safetensors")
    if kind == "file":
        return f"file://{tmp_path}/ckpt.safetensors"
    return f"memory://coatstate-tests/{uuid.uuid4().hex}/ckpt.safetensors"


@pytest.fixture
def compressed_file(tmp_path):
    model = _model()  # (expansion on: the layout with every tensor kind)
    opt = CompressedAdamW(model.parameters(), lr=1e-2, exp_avg_expand=True, exp_avg_sq_expand=True)
    _train(model, opt, 3, seed=1)
    path = str(tmp_path / "c.safetensors")
    ck.save(opt, path, model=model)
    return path, opt.state_dict(), model.state_dict()


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("kind", ["local", "file", "memory"])
def test_adamw_round_trip_is_exact(kind, tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    _train(model, opt, 2, seed=2)
    url = _url(kind, tmp_path)
    ck.save(opt, url, model=model)
    got = ck.read(url)
    _assert_same(opt.state_dict(), got.optimizer)
    _assert_same(model.state_dict(), got.model)
    assert got.header["params"]["0"]["name"] == "0.weight"


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("optimizer", ["adamw", "compressed"])
def test_resume_through_a_file_is_bit_exact(kind, optimizer, tmp_path):
    make = (
        (lambda m: CompressedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
        if optimizer == "compressed"
        else (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
    )
    model = _model(0)
    opt = make(model)
    _train(model, opt, 3, seed=3)
    url = _url(kind, tmp_path)
    ck.save(opt, url, model=model)
    _train(model, opt, 3, seed=4)

    model2 = _model(seed=99)  # different init: everything must come from the file
    opt2 = make(model2)
    ck.load(opt2, url, model=model2)
    _train(model2, opt2, 3, seed=4)
    _assert_same(model.state_dict(), model2.state_dict(), "params after resume")
    _assert_same(opt.state_dict(), opt2.state_dict(), "optimizer after resume")
    if optimizer == "compressed":
        assert "exp_avg_codes" in opt2.state_dict()["state"][0]


def test_uncompressed_file_opens_with_safe_open_and_lists_documented_keys(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1, seed=5)
    path = str(tmp_path / "adamw.safetensors")
    ck.save(opt, path, model=model)
    with safe_open(path, "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        assert torch.equal(f.get_tensor("state/0/exp_avg"), opt.state_dict()["state"][0]["exp_avg"])
    expected = {f"state/{i}/{n}" for i in range(4) for n in ("step", "exp_avg", "exp_avg_sq")}
    expected |= {f"model/{n}" for n in model.state_dict()}
    assert keys == expected
    header = json.loads(meta["coatstate"])
    assert header["format"] == "coatstate.checkpoint"
    assert header["format_version"] == schema.FORMAT_VERSION == 2
    assert meta["coatstate.header_sha256"] == schema.header_checksum(meta["coatstate"])


def test_compressed_file_layout(compressed_file):
    path, sd, _ = compressed_file
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("state/0/exp_avg_codes").dtype == torch.float8_e4m3fn
    assert {
        "state/0/exp_avg_codes",
        "state/0/exp_avg_scales",
        "state/0/exp_avg_exponents",
        "state/0/exp_avg_sq_codes",
        "state/1/exp_avg",
        "state/1/step",
    } <= keys
    header = ck.read_header(path)
    assert header["optimizer"] == {"class": "CompressedAdamW", "variant": "compressed"}
    assert header["params"]["0"]["compressed"]["exp_avg"] == {
        "format": "e4m3",
        "group_size": 128,
        "expand": True,
    }
    assert header["params"]["1"]["compressed"] == {}
    _assert_same(sd, ck.read_state_dict(path))


def test_zstd_round_trip_is_marked_in_the_header(compressed_file, tmp_path):
    path, sd, model_sd = compressed_file
    zpath = str(tmp_path / "z.safetensors")
    ck.save(sd, zpath, model=model_sd, compress="zstd")
    header = ck.read_header(zpath)
    assert header["compression"] == "zstd"
    assert header["tensors"]["model/0.weight"]["encoding"] == "zstd"  # fp32 weights do shrink
    got = ck.read(zpath)
    _assert_same(sd, got.optimizer)
    _assert_same(model_sd, got.model)


def test_missing_zstandard_names_the_package(compressed_file, tmp_path, monkeypatch):
    _, sd, _ = compressed_file
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match="pip install zstandard"):
        ck.save(sd, str(tmp_path / "z.safetensors"), compress="zstd")


def test_sharded_save_commits_through_the_root_file(compressed_file, tmp_path):
    _, sd, model_sd = compressed_file
    path = str(tmp_path / "s.safetensors")
    ck.save(sd, path, model=model_sd, shard_size=20_000)
    shards = ck.read_header(path)["shards"]
    assert len(shards) >= 3 and all(os.path.exists(tmp_path / s["file"]) for s in shards)
    with safe_open(path, "pt") as f:  # the root is itself a safetensors file (the index in its metadata)
        assert list(f.keys()) == []
    _assert_same(sd, ck.read_state_dict(path))

    with open(tmp_path / shards[1]["file"], "r+b") as f:  # corrupt one shard
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    with pytest.raises(CheckpointError, match="shard"):
        ck.read(path)

    ck.save(sd, path, model=model_sd)  # unsharded save over it removes the old shards
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors", "s.safetensors"]
    _assert_same(model_sd, ck.read(path).model)


def test_tensor_lr_and_plain_values_survive(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    _train(model, opt, 1, seed=6)
    sd = opt.state_dict()
    sd["param_groups"][0]["note"] = {"inf": float("inf"), "pair": (1, 2)}
    path = str(tmp_path / "lr.safetensors")
    ck.save(sd, path)
    _assert_same(sd, ck.read_state_dict(path))


def test_save_rejects_bad_arguments(tmp_path):
    opt = torch.optim.AdamW(_model().parameters())
    with pytest.raises(ValueError, match="compress"):
        ck.save(opt, str(tmp_path / "x.safetensors"), compress="gzip")
    with pytest.raises(ValueError, match="shard_size"):
        ck.save(opt, str(tmp_path / "x.safetensors"), shard_size=0)
    with pytest.raises(TypeError, match="state dict"):
        ck.save([1, 2], str(tmp_path / "x.safetensors"))


def test_size_is_at_most_0_28_of_torch_adamw(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((512, 256), (1024, 256), (256, 1024), (256,))]
    ref = torch.optim.AdamW(params)
    ours = CompressedAdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    ref.step()
    ours.step()
    torch.save(ref.state_dict(), tmp_path / "adamw.pt")
    ck.save(ours, str(tmp_path / "ours.safetensors"))
    ratio = os.path.getsize(tmp_path / "ours.safetensors") / os.path.getsize(tmp_path / "adamw.pt")
    print(f"file size ratio vs torch.save(AdamW): {ratio:.3f}")
    assert ratio <= 0.28, ratio


# ---------------------------------------------------------------------------------- atomicity
_CHILD = textwrap.dedent("""
    import sys, torch
    from coatstate import checkpoint as ck
    from tests.checkpoint import pause_mid_write
    pause_mid_write.install(sys.argv[2])  # every write stops halfway and says so in this file
    torch.manual_seed(1)
    sd = {"state": {0: {"step": torch.tensor(9.0), "exp_avg": torch.randn(512, 512),
                        "exp_avg_sq": torch.rand(512, 512)}},
          "param_groups": [{"lr": 0.1, "params": [0]}]}
    ck.save(sd, sys.argv[1])
""")


def test_sigkill_mid_save_keeps_the_previous_checkpoint(compressed_file, tmp_path):
    path, sd, _ = compressed_file
    before = open(path, "rb").read()
    marker = tmp_path / "halfway"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(marker)], env=child_env())
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the saving process exited before the pause point"
            assert time.monotonic() < deadline, "the saving process never reached the pause point"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # half of the new file is written at this point
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    temps = [n for n in os.listdir(tmp_path) if n.startswith(".c.safetensors.tmp-")]
    assert len(temps) == 1 and os.path.getsize(tmp_path / temps[0]) > 0  # the half-written new file
    assert open(path, "rb").read() == before
    _assert_same(sd, ck.read_state_dict(path))


# --------------------------------------------------------------------------------- corruption
def _read_or_error(path, original) -> str:
    """'error' for CheckpointError, 'same' when everything read equals the original."""
    try:
        got = ck.read(path)
    except CheckpointError:
        return "error"
    _assert_same(original[0], got.optimizer)
    _assert_same(original[1], got.model)
    return "same"


def test_truncation_at_10_offsets_raises(compressed_file, tmp_path):
    path, sd, model_sd = compressed_file
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")  # safetensors header length
    offsets = [
        0,
        4,
        8,
        9,
        8 + n // 2,
        8 + n,
        8 + n + 1,
        (8 + n + len(data)) // 2,
        len(data) - 100,
        len(data) - 1,
    ]
    bad = tmp_path / "t.safetensors"
    for cut in offsets:
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=str(bad)):
            ck.read(str(bad))


def test_100_random_byte_flips_never_load_different_data(compressed_file, tmp_path):
    path, sd, model_sd = compressed_file
    data = open(path, "rb").read()
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, len(data), (100,), generator=g).tolist()
    deltas = torch.randint(1, 256, (100,), generator=g).tolist()
    bad = tmp_path / "f.safetensors"
    outcomes = []
    for pos, delta in zip(positions, deltas, strict=False):
        flipped = bytearray(data)
        flipped[pos] ^= delta
        bad.write_bytes(bytes(flipped))
        outcomes.append(_read_or_error(str(bad), (sd, model_sd)))
    assert outcomes.count("error") >= 90, outcomes  # nearly every byte is covered by a checksum


def test_garbage_headers_raise(compressed_file, tmp_path):
    path, sd, _ = compressed_file
    data = open(path, "rb").read()
    g = torch.Generator().manual_seed(8)
    bad = tmp_path / "g.safetensors"
    cases = [
        bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()),
        (24).to_bytes(8, "little") + b"this is not json at all!" + data[32:],
        (2**40).to_bytes(8, "little") + data[8:],
        b"",
    ]
    for case in cases:
        bad.write_bytes(case)
        with pytest.raises(CheckpointError):
            ck.read(str(bad))


def _rewrite_header(path, out, edit) -> None:
    """Write `out`: the tensors of `path` under an edited header (with a valid header checksum)."""
    got = ck.read(path)
    tensors, header = encoding.flatten(got.optimizer, {}, {}, got.model)
    edit(header, tensors)
    with open(out, "wb") as f:
        container.write_safetensors(f, tensors, encoding.metadata(header))


def test_wrong_version_magic_and_missing_tensors_raise(compressed_file, tmp_path):
    path, _, _ = compressed_file
    out = str(tmp_path / "e.safetensors")
    _rewrite_header(path, out, lambda h, t: h.update(format_version=schema.FORMAT_VERSION + 1))
    with pytest.raises(CheckpointError, match=f"version {schema.FORMAT_VERSION + 1} is not .*upgrade"):
        ck.read(out)
    _rewrite_header(path, out, lambda h, t: h.update(format_version=1))  # 0.1's: refused with the fix
    with pytest.raises(CheckpointError, match=r"e\.safetensors: format version 1 .*coatstate convert"):
        ck.read(out)
    _rewrite_header(path, out, lambda h, t: h.update(format="something.else"))
    with pytest.raises(CheckpointError, match="not a coatstate checkpoint"):
        ck.read(out)
    _rewrite_header(path, out, lambda h, t: t.pop("state/0/exp_avg_scales"))
    with pytest.raises(CheckpointError, match="state/0/exp_avg_scales.*missing"):
        ck.read(out)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, out)
    with pytest.raises(CheckpointError, match="not a coatstate checkpoint"):
        ck.read(out)


def test_mismatched_optimizer_or_model_raises_naming_the_parameter(compressed_file):
    path, _, _ = compressed_file
    other = _model(hidden=96)
    opt = CompressedAdamW(other.parameters())
    with pytest.raises(CheckpointError, match=r"parameter 0\.weight .*\[96, 64\].*\[128, 64\]"):
        ck.load(opt, path)
    fewer = CompressedAdamW(list(_model().parameters())[:2])
    with pytest.raises(CheckpointError, match="param group"):
        ck.load(fewer, path)
    model = _model()
    extra = torch.nn.Sequential(*model, torch.nn.Linear(64, 2))
    opt = CompressedAdamW(model.parameters())
    with pytest.raises(CheckpointError, match="model keys differ"):
        ck.load(opt, path, model=extra)
    assert opt.state_dict()["state"] == {}  # nothing was modified before the error


class _Boom:
    def __reduce__(self):
        return (os.mkdir, (os.environ["COATSTATE_BOOM_DIR"],))


def test_pt_inputs_are_never_unpickled(tmp_path, monkeypatch):
    boom = tmp_path / "boom"
    monkeypatch.setenv("COATSTATE_BOOM_DIR", str(boom))
    torch.save({"state": {}, "param_groups": [], "x": _Boom()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        ck.read(str(tmp_path / "evil.pt"))
    assert not boom.exists()


def test_pt_optimizer_state_dict_is_read(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1, seed=9)
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    _assert_same(opt.state_dict(), ck.read_state_dict(str(tmp_path / "o.pt")))


def test_compressed_file_loads_into_torch_adamw_decompressed(compressed_file):
    path, sd, _ = compressed_file
    opt = torch.optim.AdamW(_model().parameters())
    ck.load(opt, path)
    from coatstate.formats import GroupQuantized, dequantize

    s = sd["state"][0]
    q = GroupQuantized(s["exp_avg_codes"], s["exp_avg_scales"], s["exp_avg_exponents"], 128)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], dequantize(q))


def test_memory_filesystem_leaves_no_temp_objects():
    url = f"memory://coatstate-tests/{uuid.uuid4().hex}/m.safetensors"
    ck.save(torch.optim.AdamW(_model().parameters()), url)
    fs = fsspec.filesystem("memory")
    assert [os.path.basename(p) for p in fs.ls(os.path.dirname(url[len("memory://") :]), detail=False)] == [
        "m.safetensors"
    ]


@pytest.mark.gpu
@requires_cuda
def test_resume_on_cuda_is_bit_exact(tmp_path):
    model = _model().cuda()
    opt = CompressedAdamW(model.parameters(), lr=1e-2)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(8, 64, device="cuda", generator=g) for _ in range(6)]

    def steps(m, o, batch):
        for x in batch:
            o.zero_grad()
            (m(x) - x).square().mean().backward()
            o.step()

    steps(model, opt, xs[:3])
    path = str(tmp_path / "cuda.safetensors")
    ck.save(opt, path, model=model)
    steps(model, opt, xs[3:])
    model2 = _model(seed=5).cuda()
    opt2 = CompressedAdamW(model2.parameters(), lr=1e-2)
    ck.load(opt2, path, model=model2)
    assert opt2.state_dict()["state"][0]["exp_avg_codes"].is_cuda
    steps(model2, opt2, xs[3:])
    _assert_same(model.state_dict(), model2.state_dict(), "params after resume on CUDA")


def test_a_lone_surrogate_in_the_header_is_a_checkpoint_error(tmp_path):
    """A header no writer of ours makes (a lone UTF-16 surrogate cannot be UTF-8 encoded, so its
    checksum cannot be computed): one CheckpointError, not a UnicodeEncodeError."""
    model = _model()
    opt = CompressedAdamW(model.parameters(), min_numel=1)
    path = tmp_path / "c.safetensors"
    ck.save(opt, path, model=model)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    st = json.loads(data[8 : 8 + n])
    st["__metadata__"][schema.METADATA_KEY] = st["__metadata__"][schema.METADATA_KEY][:-1] + ',"x":"\ud800"}'
    head = json.dumps(st).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
    path.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n :])
    with pytest.raises(CheckpointError, match="header checksum mismatch"):
        ck.read(path)


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("layout", ["gathered", "per_rank", "sharded"])
def test_a_save_into_a_missing_directory_makes_it(tmp_path, layout, kind):
    model = _model()
    opt = CompressedAdamW(model.parameters(), min_numel=1)
    _train(model, opt, 1, seed=0)
    root = str(tmp_path) if kind == "local" else f"memory://coatstate-tests/{uuid.uuid4().hex}"
    url = f"{root}/missing/deeper/c.safetensors"
    if layout == "per_rank" and kind == "memory":  # DCP's FileSystemWriter: local files only
        with pytest.raises(ValueError, match="needs a \\(shared\\) local filesystem.*distributed='gathered'"):
            ck.save(opt, url, distributed="per_rank")
        return
    distributed, shard_size = ("gathered", 20_000) if layout == "sharded" else (layout, ck.DEFAULT_SHARD_SIZE)
    ck.save(opt, url, model=model, distributed=distributed, shard_size=shard_size)
    assert ck.read(url).header["format_version"] == schema.FORMAT_VERSION  # one version, every layout
    _assert_same(ck.read(url).optimizer, ck.read_state_dict(url))
    fresh = CompressedAdamW(_model(seed=1).parameters(), min_numel=1)
    ck.load(fresh, url)
    _assert_same(fresh.state_dict(), opt.state_dict())


@pytest.mark.parametrize("layout", ["gathered", "per_rank"])
def test_a_file_where_the_directory_should_be_is_named(tmp_path, layout):
    model = _model()
    opt = CompressedAdamW(model.parameters(), min_numel=1)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a_file"):
        ck.save(opt, tmp_path / "a_file" / "sub" / "c.safetensors", distributed=layout)


def test_a_per_rank_root_of_0_2_is_refused_naming_the_fix(compressed_file, tmp_path):
    """0.2's per-rank roots (a version 2 header with a `per_rank` index of rank files) went with
    its home-made commit protocol: refused in one line that says how to convert them."""
    _, sd, _ = compressed_file
    url = tmp_path / "old.safetensors"
    ck.save(sd, url)
    header = ck.read_header(url)
    header.update(format_version=2, per_rank={"save_id": "0123abcd", "world_size": 1, "files": []})
    with open(url, "wb") as f:
        container.write_safetensors(f, {}, encoding.metadata(header))
    with pytest.raises(CheckpointError, match=r"old.safetensors.*per-rank root of coatstate 0\.2.*convert"):
        ck.read(url)


def test_a_shard_symlinked_out_of_the_directory_is_refused(compressed_file, tmp_path):
    """A shard must be a file of the root's directory: a symlink to a true copy elsewhere, or a
    loop, is one CheckpointError before anything is read through it."""
    _, sd, model_sd = compressed_file
    inside, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    path = str(inside / "s.safetensors")
    ck.save(sd, path, model=model_sd, shard_size=20_000)
    name = ck.read_header(path)["shards"][1]["file"]
    os.replace(inside / name, outside / name)
    os.symlink(outside / name, inside / name)  # the true bytes, out of the directory
    with pytest.raises(CheckpointError, match="outside the checkpoint's directory"):
        ck.read(path)
    os.unlink(inside / name)
    os.symlink(inside / name, inside / name)  # a loop
    with pytest.raises(CheckpointError):
        ck.read(path)


def test_a_checkpoint_prints_as_a_short_summary(compressed_file):
    path, _, _ = compressed_file
    text = repr(ck.read(path))
    assert len(text) < 300 and "tensor(" not in text, text
    assert text.startswith("Checkpoint(CompressedAdamW, 1 param groups, 4 params with state, ")
    assert "float8_e4m3fn x" in text and "model 4 tensors" in text and "KiB" in text, text


@pytest.mark.parametrize("name", ["save", "load", "read"])
def test_entry_points_document_args_returns_raises_and_an_example(name):
    import coatstate

    doc = getattr(coatstate, name).__doc__
    assert all(f"\n    {section}:\n" in doc for section in ("Args", "Returns", "Raises", "Example")), name
    assert all(f"\n    {section}:\n" in coatstate.Checkpoint.__doc__ for section in ("Args", "Example"))
    assert "\n    Example:\n" in coatstate.CheckpointError.__doc__


def test_the_documented_signatures_are_the_real_ones():
    """docs/CHECKPOINT.md's first code block names each function where it lives, with its arguments."""
    import inspect
    import re

    import coatstate

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "CHECKPOINT.md")).read()
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    calls = re.findall(r"^(coatstate(?:\.\w+)+)\((.*?)\)\s*(?:#|$)", block.replace(",\n", ", "), re.M)
    assert len(calls) == 7, calls
    for dotted, args in calls:
        obj = coatstate
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)  # AttributeError: documented where it does not live
        documented = [a.split("=")[0].strip(" *") for a in args.split(",") if a.strip(" *")]
        assert documented == list(inspect.signature(obj).parameters), dotted


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("layout", ["single", "sharded", "per_rank"])
def test_each_call_resolves_its_url_once(tmp_path, monkeypatch, kind, layout):
    """save, read and load resolve (fs, path) from the URL once and pass it down."""
    model = _model()
    opt = CompressedAdamW(model.parameters(), min_numel=1)
    _train(model, opt, 1, seed=0)
    url = _url(kind, tmp_path)
    if layout == "per_rank" and kind == "memory":
        pytest.skip("per-rank saves write local files (DCP's FileSystemWriter)")
    options = {"sharded": {"shard_size": 20_000}, "per_rank": {"distributed": "per_rank"}}.get(layout, {})
    ck.save(opt, url, model=model, **options)  # (a previous root, as most saves replace one)
    real, calls = fsspec.core.url_to_fs, []
    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda u, *a, **k: calls.append(u) or real(u, *a, **k))
    for run in (
        lambda: ck.save(opt, url, model=model, **options),
        lambda: ck.read(url),
        lambda: ck.load(opt, url, model=model),
    ):
        calls.clear()
        run()
        assert calls == [url], calls
