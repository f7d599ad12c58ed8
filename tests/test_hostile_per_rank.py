"""Hostile and broken per-rank checkpoints: every case is refused with a CheckpointError, or loads
bit-identical.

A per-rank root is an ordinary coatstate header plus a `per_rank` index naming rank files, their
sizes, manifest sha256s and the row ranges of each tensor in each file (docs/CHECKPOINT.md). A
buggy or malicious writer controls all of it, header checksum included, so the root is edited
here with that checksum recomputed, and the rank files with their manifest sha256 and size in the
root recomputed. Every case must be one CheckpointError naming the root (the CLI: exit 1, one
line on stderr), leave the target model and optimizer as they were, open nothing outside the
checkpoint's directory and allocate nothing the files do not back. Counts are printed (-s).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections import Counter

import pytest
import torch
from coatstate.formats.schema import CheckpointError
from test_hostile_input import _bits, _deadline, _with_header

from coatstate import checkpoint as ck
from coatstate.checkpoint import container, rank_files, rank_read
from coatstate.cli import main as cli
from coatstate.optim import CompressedAdamW

_OPENED: list[str] | None = None
"""While a list: every path the process opens (an audit hook; hooks cannot be removed)."""


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


# ------------------------------------------------------------------------------ the targets
def _small_model() -> torch.nn.Module:
    torch.manual_seed(7)
    # the weights get FP8 moments (codes and scales), the biases float32 ones
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))


def _small_train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 32, generator=g)
        opt.zero_grad()
        (model(x) - x).square().mean().backward()
        opt.step()


class Target:
    """A model and optimizer with state of their own, to load into and compare afterwards."""

    def __init__(self, make):
        self.make = make
        self.model, self.opt = make()
        self.before = self.snapshot()

    def snapshot(self):
        return _bits(self.model.state_dict()), _bits(self.opt.state_dict())


def _small_target():
    model = _small_model()
    opt = CompressedAdamW(model.parameters(), lr=1e-2)
    _small_train(model, opt, 1, seed=7)
    return model, opt


class Saved:
    """A good per-rank checkpoint: its directory, root bytes, rank files and what it loads as."""

    def __init__(self, directory, make_target):
        self.dir, self.make_target = str(directory), make_target
        self.root = open(os.path.join(self.dir, "ckpt.safetensors"), "rb").read()
        self.files = [f["file"] for f in ck.read_header(self.path)["per_rank"]["files"]]
        self.data = {n: open(os.path.join(self.dir, n), "rb").read() for n in self.files}
        good = Target(make_target)
        ck.load(good.opt, self.path, model=good.model)
        self.loaded = good.snapshot()

    @property
    def path(self) -> str:
        return os.path.join(self.dir, "ckpt.safetensors")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """A world of one (no process group): one rank file holding every row."""
    base = tmp_path_factory.mktemp("per_rank_one")
    model = _small_model()
    opt = CompressedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    _small_train(model, opt, 2, seed=1)
    ck.save(opt, str(base / "ckpt.safetensors"), model=model, distributed="per_rank")
    return Saved(base, _small_target)


def _two_rank_worker(rank, world_size, port, out):
    import torch.distributed as dist
    from test_distributed import _fsdp, _init, _optimizer, _train

    mesh = _init(rank, world_size, port)
    model = _fsdp(mesh)
    opt = _optimizer(model)
    _train(model, opt, 0, 1)
    import coatstate

    coatstate.save(opt, os.path.join(out, "ckpt.safetensors"), model=model, distributed="per_rank")
    dist.barrier()
    dist.destroy_process_group()


def _big_target():
    from test_distributed import _model, _optimizer, _train

    model = _model()
    opt = _optimizer(model)
    _train(model, opt, 5, 1)
    return model, opt


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """FSDP2 on 2 gloo ranks: two rank files, each tensor's rows cut between them."""
    if not torch.distributed.is_available() or sys.platform == "win32":
        pytest.skip("needs torch.distributed with gloo")
    from test_distributed_checkpoint import _start

    base = tmp_path_factory.mktemp("per_rank_two")
    _start(_two_rank_worker, 2, str(base))
    return Saved(base, _big_target)


# ------------------------------------------------------------------------------- the judge
def _case(tmp_path, saved: Saved, name: str, root: bytes | None = None, files: dict | None = None):
    """A directory holding the good checkpoint with `root` and `files` ({name: bytes}) replaced."""
    d = tmp_path / "".join(c if c.isalnum() else "_" for c in name)
    while d.exists():  # names that differ only in punctuation
        d = d.with_name(d.name + "_")
    d.mkdir()
    (d / "ckpt.safetensors").write_bytes(saved.root if root is None else root)
    for n, data in {**saved.data, **(files or {})}.items():
        if data is not None:
            (d / n).write_bytes(data)
    return d


def _cli_line(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(argv)
    err = capsys.readouterr().err
    if code:
        assert err.count("\n") == 1 and argv[1] in err, (argv, err)
        assert "Traceback" not in err and "unexpected error" not in err, (argv, err)
    return code, err


def _judge(saved: Saved, target: Target, d, capsys, strict_inspect: bool, outside=(), full=True) -> str:
    """'refused' or 'same' for the checkpoint in directory `d`, after checking load, read and the
    CLI (not `full`: load, read and inspect --verify); `outside`: paths never to be opened."""
    global _OPENED
    url = str(d / "ckpt.safetensors")
    _OPENED = []
    try:
        with _deadline(20, url):
            outcome = _load(saved, target, url)
            try:
                ck.read(url)
                read_ok = True
            except CheckpointError as e:
                assert url in str(e), str(e)
                read_ok = False
            assert read_ok or outcome == "refused", f"{url}: loads but read() refuses it"
            codes = {"verify": _cli_line(["inspect", url, "--verify"], capsys)[0]}
            if full:
                _unverified_and_partial_reads(url)
                codes["inspect"] = _cli_line(["inspect", url], capsys)[0]
                codes["convert"] = _cli_line(["convert", url, str(d / "out.safetensors")], capsys)[0]
    finally:
        opened, _OPENED = _OPENED, None
    leaks = [p for p in opened for o in outside if os.path.realpath(p).startswith(os.path.realpath(o))]
    assert not leaks, f"{url}: opened {leaks[:3]} outside the checkpoint's directory"
    if outcome == "refused":
        assert codes["verify"] == codes.get("convert", 1) == 1, (url, codes)
        assert codes.get("inspect", 1) == 1 or not strict_inspect, (url, codes)
    else:
        assert set(codes.values()) == {0}, (url, codes)
    return outcome


def _unverified_and_partial_reads(url: str) -> None:
    """read(verify=False), and the second half of the rows of the model's and the first
    parameter's tensors as a rank of a sharded load reads them (rank_read's range reads): a
    CheckpointError naming the root, or data."""
    try:
        ck.read(url, verify=False)
    except CheckpointError as e:
        assert url in str(e), str(e)
    try:
        header = ck.read_header(url)
    except CheckpointError as e:
        assert url in str(e), str(e)
        return
    for key, info in header["tensors"].items():  # a reader each: no file checked by another key
        if not key.startswith(("model/", "state/0/")):
            continue
        rows = rank_files.num_rows(info["shape"])
        try:
            rank_read._Reader(url, header, verify=True).rows(key, rows // 2, rows)
        except CheckpointError as e:
            assert url in str(e), str(e)


def _load(saved: Saved, target: Target, url: str) -> str:
    try:
        ck.load(target.opt, url, model=target.model)
    except CheckpointError as e:
        assert url in str(e), f"the error does not name the root: {e}"
        assert target.snapshot() == target.before, f"a failed load of {url} changed the target"
        return "refused"
    assert target.snapshot() == saved.loaded, f"{url} loaded other bits than the good checkpoint"
    return "same"


def _run(cases, saved: Saved, tmp_path, capsys, wrong: list, strict_inspect=True, allow_same=(), full=True):
    """Judge every (name, root bytes, files, outside) case, adding what went wrong to `wrong`;
    a fresh target after each load."""
    target, outcomes = Target(saved.make_target), Counter()
    for name, root, files, outside in cases:
        d = _case(tmp_path, saved, name, root, files)
        if callable(outside):  # a case that sets up special files in its directory
            outside = outside(d)
        try:
            outcome = _judge(saved, target, d, capsys, strict_inspect, outside, full)
        except Exception as e:  # noqa: BLE001 - every case is run; all failures reported at once
            wrong.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            target = Target(saved.make_target)
            continue
        outcomes[outcome] += 1
        if outcome == "same":
            target = Target(saved.make_target)
            if name not in allow_same:
                wrong.append(f"{name}: loaded although hostile")
    return outcomes


# -------------------------------------------------------------------------------- root edits
def _index(fn):
    return lambda h: fn(h["per_rank"])


def _file0(**kw):
    return _index(lambda p: p["files"][0].update(**kw))


def _split_of(key: str, pieces) -> object:
    """Tensor `key` cut as `pieces` (a new split of its own)."""

    def edit(h):
        h["per_rank"]["splits"].append(pieces)
        h["per_rank"]["tensor_splits"][key] = len(h["per_rank"]["splits"]) - 1

    return edit


def _huge(key: str, rows: int):
    """A shape claim of `rows` rows for `key`, with a split that covers them: no file backs it."""

    def edit(h):
        h["tensors"][key]["shape"][0] = rows
        _split_of(key, [[0, 0, rows]])(h)

    return edit


def _deep(depth: int):
    return "[" * depth + "]" * depth


def _text_before_world_size(text: str) -> dict:
    """An edit of the root's JSON text (what json.dumps cannot write: deep or duplicate keys)."""
    return dict(edit_text=lambda t: t.replace('"world_size":', text + '"world_size":', 1))


W = "model/0.weight"  # 128 rows of 32 float32 in the world of one
ROOT_EDITS = {
    "index": {
        "per_rank a list": lambda h: h.update(per_rank=[]),
        "per_rank a string": lambda h: h.update(per_rank="ckpt"),
        "per_rank a number": lambda h: h.update(per_rank=3),
        "per_rank true": lambda h: h.update(per_rank=True),
        "per_rank empty": lambda h: h.update(per_rank={}),
        "files an object": _index(lambda p: p.update(files={"0": p["files"][0]})),
        "files a string": _index(lambda p: p.update(files="ckpt")),
        "files entry a string": _index(lambda p: p["files"].__setitem__(0, p["files"][0]["file"])),
        "files entry a list": _index(lambda p: p["files"].__setitem__(0, list(p["files"][0].values()))),
        "files empty": _index(lambda p: p.update(files=[])),
        "no rank": _index(lambda p: p["files"][0].pop("rank")),
        "rank -1": _file0(rank=-1),
        "rank a string": _file0(rank="0"),
        "world_size 0": _index(lambda p: p.update(world_size=0)),
        "world_size true": _index(lambda p: p.update(world_size=True)),
        "save_id a number": _index(lambda p: p.update(save_id=12345678)),
        "save_id another": _index(lambda p: p.update(save_id="00000000")),
        "duplicate file entry": _index(lambda p: p["files"].append(dict(p["files"][0]))),
        "duplicate file, rank 1": _index(lambda p: p["files"].append({**p["files"][0], "rank": 1})),
        "with shards": lambda h: h.update(shards=[]),
        "with compression": lambda h: h.update(compression="zstd"),
        "nested 100 deep": _text_before_world_size(f'"x":{_deep(100)},'),
        "nested 10**5 deep": _text_before_world_size(f'"x":{_deep(10**5)},'),
        "duplicate key": _text_before_world_size('"world_size":2,'),
        "splits an object": _index(lambda p: p.update(splits={})),
        "tensor_splits a list": _index(lambda p: p.update(tensor_splits=[])),
        "tensor_splits missing a key": _index(lambda p: p["tensor_splits"].pop(W)),
        "tensor_splits extra key": _index(lambda p: p["tensor_splits"].update({"model/x": 0})),
        "tensor_splits 99": _index(lambda p: p["tensor_splits"].update({W: 99})),
        "tensor_splits -1": _index(lambda p: p["tensor_splits"].update({W: -1})),
        "tensor_splits a string": _index(lambda p: p["tensor_splits"].update({W: "1"})),
        "tensor_splits 1.0": _index(lambda p: p["tensor_splits"].update({W: 1.0})),
        "tensor split of another shape": _index(lambda p: p["tensor_splits"].update({W: 2})),
        "step on a 128-row split": _index(lambda p: p["tensor_splits"].update({"state/0/step": 1})),
    },
    "names": {
        "../ name": _file0(file="../x/ckpt-{id}-rank00000-of-00001.safetensors"),
        "./ name": _file0(file="./ckpt-{id}-rank00000-of-00001.safetensors"),
        "sub/../ name": _file0(file="sub/../ckpt-{id}-rank00000-of-00001.safetensors"),
        "..\\ name": _file0(file="..\\ckpt-{id}-rank00000-of-00001.safetensors"),
        "absolute name": _file0(file="{outside}/ckpt-{id}-rank00000-of-00001.safetensors"),
        "file:// name": _file0(file="file://{outside}/ckpt-{id}-rank00000-of-00001.safetensors"),
        "memory:// name": _file0(file="memory://ckpt-{id}-rank00000-of-00001.safetensors"),
        "s3:// name": _file0(file="s3://bucket/ckpt-{id}-rank00000-of-00001.safetensors"),
        "NUL in name": _file0(file="ckpt-{id}-rank00000-of-00001.safetensors\x00"),
        "newline in name": _file0(file="ckpt-{id}-rank00000-of-00001.safetensors\n"),
        "a number as name": _file0(file=7),
        "null name": _file0(file=None),
        "another stem": _file0(file="other-{id}-rank00000-of-00001.safetensors"),
        "another save id": _file0(file="ckpt-0badc0de-rank00000-of-00001.safetensors"),
        "a temp file": _file0(file="ckpt-{id}-rank00000-of-00001.safetensors.tmp-0123456789ab"),
        "a hidden file": _file0(file=".ckpt-{id}-rank00000-of-00001.safetensors"),
        "the root itself": _file0(file="ckpt.safetensors"),
    },
    "row ranges": {
        "overlap": _split_of(W, [[0, 0, 64], [0, 32, 128]]),
        "gap": _split_of(W, [[0, 0, 64], [0, 65, 128]]),
        "past the rows": _split_of(W, [[0, 0, 200]]),
        "short of the rows": _split_of(W, [[0, 0, 100]]),
        "negative start": _split_of(W, [[0, -1, 128]]),
        "float stop": _split_of(W, [[0, 0, 128.0]]),
        "bool start": _split_of(W, [[0, False, 128]]),
        "strings": _split_of(W, [["0", "0", "128"]]),
        "a pair": _split_of(W, [[0, 128]]),
        "four numbers": _split_of(W, [[0, 0, 128, 0]]),
        "file index 1": _split_of(W, [[1, 0, 128]]),
        "file index -1": _split_of(W, [[-1, 0, 128]]),
        "file index true": _split_of(W, [[True, 0, 128]]),
        "empty piece first": _split_of(W, [[0, 0, 0], [0, 0, 128]]),
        "reversed": _split_of(W, [[0, 128, 0]]),
        "out of order": _split_of(W, [[0, 64, 128], [0, 0, 64]]),
        "split an object": _split_of(W, {"0": [0, 0, 128]}),
        "piece an object": _split_of(W, [{"file": 0, "start": 0, "stop": 128}]),
        "no pieces": _split_of(W, []),
        "2**64 rows": _split_of(W, [[0, 0, 2**64]]),
        "cut in two in one file": _split_of(W, [[0, 0, 64], [0, 64, 128]]),
    },
    "sizes": {
        "bytes 2**62": _file0(bytes=2**62),
        "bytes one short": _index(lambda p: p["files"][0].update(bytes=p["files"][0]["bytes"] - 1)),
        "bytes one more": _index(lambda p: p["files"][0].update(bytes=p["files"][0]["bytes"] + 1)),
        "bytes -1": _file0(bytes=-1),
        "bytes a float": _file0(bytes=57184.0),
        "bytes a string": _file0(bytes="57184"),
        "2**40 rows claimed": _huge(W, 2**40),
        "2**62 rows claimed": _huge(W, 2**62),
        "2**40 rows of a moment": _huge("state/0/exp_avg_codes", 2**40),
        "one more row": _huge(W, 129),
        "wider rows": lambda h: h["tensors"][W]["shape"].__setitem__(1, 2**40),
        "3-d shape, same bytes": lambda h: h["tensors"][W].update(shape=[128, 32, 1]),
        "0-d shape": lambda h: h["tensors"][W].update(shape=[]),
    },
    "dtypes and checksums": {
        "float16 for float32": lambda h: h["tensors"][W].update(dtype="float16"),
        "float64 for float32": lambda h: h["tensors"][W].update(dtype="float64"),
        "int32 for float32": lambda h: h["tensors"][W].update(dtype="int32"),
        "uint8 codes as int8": lambda h: h["tensors"]["state/0/exp_avg_codes"].update(dtype="int8"),
        "manifest sha256 zeros": _file0(manifest_sha256="0" * 64),
        "manifest sha256 upper case": lambda h: h["per_rank"]["files"][0].update(
            manifest_sha256=h["per_rank"]["files"][0]["manifest_sha256"].upper()
        ),
        "manifest sha256 a number": _file0(manifest_sha256=0),
        "no manifest sha256": _index(lambda p: p["files"][0].pop("manifest_sha256")),
        "a zstd encoding": lambda h: h["tensors"][W].update(encoding="zstd", stored_bytes=16384),
        "a zstd encoding of the step": lambda h: h["tensors"]["state/0/step"].update(
            encoding="zstd", stored_bytes=4
        ),
        "a step of 0 rows": lambda h: (
            h["tensors"]["state/0/step"].update(shape=[0]),
            _split_of("state/0/step", [])(h),
        ),
        "a step of 2 rows": lambda h: (
            h["tensors"]["state/0/step"].update(shape=[2]),
            _split_of("state/0/step", [[0, 0, 2]])(h),
        ),
        "tensor checksum of another": lambda h: h["tensors"][W].update(
            checksum=h["tensors"]["model/2.weight"]["checksum"]
        ),
    },
}


def _fill(obj, **values):
    """`obj` with '{id}' and '{outside}' filled in, in every string."""
    if isinstance(obj, str):
        return obj.replace("{id}", values["id"]).replace("{outside}", values["outside"])
    if isinstance(obj, dict):
        return {k: _fill(v, **values) for k, v in obj.items()}
    return [_fill(v, **values) for v in obj] if isinstance(obj, list) else obj


def _no_zstandard():
    raise ImportError("zstandard is not installed (simulated)")


def test_root_edits_with_a_valid_checksum_are_refused(one, tmp_path, capsys, monkeypatch):
    # a per-rank root never needs zstd: an install without the optional package must refuse a
    # root that claims it with a CheckpointError too
    monkeypatch.setattr(container, "_zstd", _no_zstandard)
    outside = tmp_path / "outside"
    outside.mkdir()
    for n, data in one.data.items():  # a real copy out there: opening it would load fine
        (outside / n).write_bytes(data)
    save_id = ck.read_header(one.path)["per_rank"]["save_id"]
    counts, wrong = {}, []
    for cls, edits in ROOT_EDITS.items():
        cases = []
        for name, edit in edits.items():

            def filled(h, edit=edit):
                if callable(edit):
                    edit(h)
                h["per_rank"] = _fill(h["per_rank"], id=save_id, outside=str(outside))

            text = None if callable(edit) else edit["edit_text"]
            root = _with_header(one.root, edit=filled, edit_text=text)
            cases.append((f"{cls} {name}", root, None, [str(outside)]))
        counts[cls] = _run(cases, one, tmp_path, capsys, wrong, strict_inspect=cls != "dtypes and checksums")
    assert not wrong, "\n".join(wrong)
    print(
        "per-rank root edits with the header checksum recomputed: "
        + ", ".join(f"{cls} {sum(c.values())} {dict(c)}" for cls, c in counts.items())
    )
    assert all(c["refused"] == len(ROOT_EDITS[cls]) for cls, c in counts.items())


# -------------------------------------------------------------------- what the rank file is
def _root_claims(saved: Saved, **kw) -> bytes:
    """The root with rank file 0's entry changed (its size claim, its manifest sha256)."""
    return _with_header(saved.root, edit=_file0(**kw))


def _replace(make):
    """A setup that replaces rank file 0 of the case directory: make(path, its good bytes, an
    outside directory) creates it and returns the paths it points at outside (never opened)."""

    def setup(d):
        path = next(p for p in d.iterdir() if "-rank00000-" in p.name)
        data = path.read_bytes()
        path.unlink()
        outside = d.parent / f"outside-{d.name}"
        outside.mkdir()
        return [str(outside), *make(path, data, outside)]

    return setup


def _link_to_copy(path, data, outside):
    (outside / path.name).write_bytes(data)  # the true bytes: opening them would load fine
    os.symlink(outside / path.name, path)
    return []


def _link_via_dotdot(path, data, outside):
    (outside / path.name).write_bytes(data)
    os.symlink(os.path.join("..", outside.name, path.name), path)
    return []


def _link_to(target: str):
    # (every path is under /: there only the result is checked)
    return lambda path, data, outside: (os.symlink(target, path), [target] if target != "/" else [])[1]


def _loop(path, data, outside):
    os.symlink(path.name + ".b", path)
    os.symlink(path.name, str(path) + ".b")
    return []


def _within(make_bytes):
    return lambda path, data, outside: (path.write_bytes(make_bytes(data)), [])[1]


SPECIAL = {  # name: (what rank file 0 is, what the root claims of it)
    "missing": (lambda path, data, outside: [], {}),
    "a FIFO": (lambda path, data, outside: (os.mkfifo(path), [])[1], {}),
    "a FIFO, 0 bytes claimed": (lambda path, data, outside: (os.mkfifo(path), [])[1], {"bytes": 0}),
    "a directory": (lambda path, data, outside: (path.mkdir(), [])[1], {}),
    "a directory, its size claimed": (lambda path, data, outside: (path.mkdir(), [])[1], {"bytes": "dir"}),
    "empty": (_within(lambda data: b""), {}),
    "empty, 0 bytes claimed": (_within(lambda data: b""), {"bytes": 0}),
    "a symlink to a true copy outside": (_link_to_copy, {}),
    "a relative symlink out through ..": (_link_via_dotdot, {}),
    "a symlink to /dev/zero": (_link_to("/dev/zero"), {}),
    "a symlink to /dev/zero, 0 bytes claimed": (_link_to("/dev/zero"), {"bytes": 0}),
    "a symlink to /etc/hostname": (_link_to("/etc/hostname"), {"bytes": "target"}),
    "a symlink to /": (_link_to("/"), {"bytes": "target"}),
    "a dangling symlink": (_link_to("/nonexistent/coatstate-rank-file"), {}),
    "a symlink loop": (_loop, {}),
    "a symlink to the root": (lambda path, data, outside: (os.symlink("ckpt.safetensors", path), [])[1], {}),
}


def test_special_rank_files_are_refused(one, tmp_path, capsys):
    cases = []
    for name, (make, claims) in SPECIAL.items():
        setup = _replace(make)

        def claimed(d, setup=setup, claims=claims):
            path = next(p for p in d.iterdir() if "-rank00000-" in p.name)
            outside = setup(d)
            kw = dict(claims)
            if kw.get("bytes") in ("dir", "target"):  # what a stat of it says, to get past that check
                kw["bytes"] = os.stat(path).st_size
            if kw:
                (d / "ckpt.safetensors").write_bytes(_root_claims(one, **kw))
            return outside

        cases.append((name, None, None, claimed))
    wrong = []
    counts = _run(cases, one, tmp_path, capsys, wrong)
    assert not wrong, "\n".join(wrong)
    print(f"rank file 0 missing, a FIFO, a directory, empty, a symlink: {len(cases)} cases, {dict(counts)}")
    assert counts["refused"] == len(cases)


# --------------------------------------------------------- rank file edits, root recomputed
def _rank_edit(saved: Saved, i: int = 0, manifest=None, manifest_text=None, outer=None, raw=None):
    """Rank file `i` with its manifest or safetensors header edited, and the root's size and
    manifest sha256 of it recomputed (a writer that got its file wrong, consistently)."""
    data = saved.data[saved.files[i]]
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8 : 8 + n])
    text = head["__metadata__"][rank_files.MANIFEST_KEY]
    if manifest is not None:
        m = json.loads(text)
        manifest(m)
        text = json.dumps(m, separators=(",", ":"))
    if manifest_text is not None:
        text = manifest_text(text)
    head["__metadata__"][rank_files.MANIFEST_KEY] = text
    if outer is not None:
        outer(head)
    st = json.dumps(head, separators=(",", ":")).encode()  # ASCII: a lone surrogate stays escaped
    st += b" " * (-len(st) % 8)
    new = struct.pack("<Q", len(st)) + st + data[8 + n :]
    if raw is not None:
        new = raw(new)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def edit(h):
        h["per_rank"]["files"][i].update(bytes=len(new), manifest_sha256=digest)

    return _with_header(saved.root, edit=edit), {saved.files[i]: new}


def _piece(key: str, **kw):
    return dict(manifest=lambda m: m["pieces"][key].update(**kw))


def _entry(key: str, **kw):
    return dict(outer=lambda h: h[key].update(**kw))


def _same_bytes_as(key: str, other: str):
    return dict(outer=lambda h: h[key].update(data_offsets=h[other]["data_offsets"]))


def _swap_offsets(a: str, b: str):
    def edit(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]

    return dict(outer=edit)


W2 = "model/2.weight"  # 32 x 128 float32: as many bytes as W
RANK_EDITS = {
    "a list as a piece": dict(manifest=lambda m: m["pieces"].update({W: []})),
    "a non-empty list as a piece": dict(manifest=lambda m: m["pieces"].update({W: [0, 128]})),
    "a string as a piece": dict(manifest=lambda m: m["pieces"].update({W: "rows"})),
    "a list as pieces": dict(manifest=lambda m: m.update(pieces=[])),
    "a list as manifest": dict(manifest_text=lambda t: "[]"),
    "rows 0..127": _piece(W, rows=[0, 127]),
    "rows as strings": _piece(W, rows=["0", "128"]),
    "rows 1..129": _piece(W, rows=[1, 129]),
    "block_rows 0": _piece(W, block_rows=0),
    "block_rows 1": _piece(W, block_rows=1),
    "block_rows 2**70": _piece(W, block_rows=2**70),
    "checksums a string": _piece(W, checksums="sha256:0"),
    "checksums numbers": _piece(W, checksums=[0]),
    "no checksums": _piece(W, checksums=[]),
    "another block's checksum": dict(
        manifest=lambda m: m["pieces"][W].update(checksums=m["pieces"][W2]["checksums"])
    ),
    "another save id": dict(manifest=lambda m: m.update(save_id="0badc0de")),
    "rank 1": dict(manifest=lambda m: m.update(rank=1)),
    "rank true": dict(manifest=lambda m: m.update(rank=True)),
    "no save id": dict(manifest=lambda m: m.pop("save_id")),
    "an extra piece": dict(manifest=lambda m: m["pieces"].update({"model/x": m["pieces"][W]})),
    "a piece missing": dict(manifest=lambda m: m["pieces"].pop(W)),
    "manifest not JSON": dict(manifest_text=lambda t: t[:-1]),
    "manifest 100 deep": dict(manifest_text=lambda t: t[:-1] + ',"x":' + _deep(100) + "}"),
    "manifest 10**5 deep": dict(manifest_text=lambda t: t[:-1] + ',"x":' + _deep(10**5) + "}"),
    "manifest NaN": dict(manifest_text=lambda t: t.replace('"rank":0', '"rank":NaN', 1)),
    "manifest duplicate key": dict(manifest_text=lambda t: t.replace('"rank":0', '"rank":0,"rank":1', 1)),
    "manifest lone surrogate": dict(manifest_text=lambda t: t[:-1] + ',"x":"\ud800"}'),
    "manifest in a lone surrogate": dict(manifest_text=lambda t: t + "\udcff"),
    "metadata a list": dict(outer=lambda h: h.update(__metadata__=["x"])),
    "metadata a string": dict(outer=lambda h: h.update(__metadata__="x")),
    "no manifest": dict(outer=lambda h: h["__metadata__"].pop(rank_files.MANIFEST_KEY)),
    "manifest a number": dict(outer=lambda h: h["__metadata__"].update({rank_files.MANIFEST_KEY: 7})),
    "tensor entry a list": dict(outer=lambda h: h.update({W: ["F32"]})),
    "tensor entry a string": dict(outer=lambda h: h.update({W: "F32"})),
    "tensor entry missing": dict(outer=lambda h: h.pop(W)),
    "F16 in the file": _entry(W, dtype="F16"),
    "U8 in the file": _entry(W, dtype="U8"),
    "dtype a number": _entry(W, dtype=7),
    "shape 64 x 32": _entry(W, shape=[64, 32]),
    "shape 128 x 32 x 1": _entry(W, shape=[128, 32, 1]),
    "shape flat": _entry(W, shape=[4096]),
    "shape strings": _entry(W, shape=["128", "32"]),
    "offsets past the file": _entry(W, data_offsets=[0, 2**62]),
    "offsets negative": _entry(W, data_offsets=[-16384, 0]),
    "offsets floats": _entry(W, data_offsets=[0.0, 16384.0]),
    "offsets reversed": dict(outer=lambda h: h[W].update(data_offsets=h[W]["data_offsets"][::-1])),
    "offsets one short": dict(
        outer=lambda h: h[W]["data_offsets"].__setitem__(1, h[W]["data_offsets"][1] - 4)
    ),
    "offsets a string": _entry(W, data_offsets="0-16384"),
    "the bytes of another tensor": _same_bytes_as(W, W2),
    "offsets swapped with another": _swap_offsets(W, W2),
    "header length 2**63": dict(raw=lambda b: struct.pack("<Q", 2**63) + b[8:]),
    "header length past the file": dict(raw=lambda b: struct.pack("<Q", len(b)) + b[8:]),
    "header not UTF-8": dict(raw=lambda b: b[:8] + b"\xff" + b[9:]),
    "truncated in the data": dict(raw=lambda b: b[:-100]),
    "4 KiB appended": dict(raw=lambda b: b + bytes(4096)),
}


def test_rank_file_edits_with_the_root_recomputed(one, tmp_path, capsys):
    cases = []
    for name, edit in RANK_EDITS.items():
        root, files = _rank_edit(one, **edit)
        cases.append((name, root, files, []))
    wrong = []
    # appended bytes no piece points at are harmless (the root's size claim covers them)
    counts = _run(cases, one, tmp_path, capsys, wrong, strict_inspect=False, allow_same={"4 KiB appended"})
    assert not wrong, "\n".join(wrong)
    print(f"rank file edits, the root's size and manifest sha256 recomputed: {len(cases)}, {dict(counts)}")
    assert counts["refused"] >= len(cases) - 1


# ------------------------------------------------------------------ bit flips, truncations
def _flips(data: bytes, ranges, count: int, seed: int):
    """`count` copies of `data` with one bit flipped, spread over the byte `ranges`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(count):
        lo, hi = ranges[j % len(ranges)]
        pos, bit = int(torch.randint(lo, hi, (1,), generator=g)), int(torch.randint(0, 8, (1,), generator=g))
        flipped = bytearray(data)
        flipped[pos] ^= 1 << bit
        out.append((pos, bytes(flipped)))
    return out


def test_bit_flips_and_truncations_are_refused_or_harmless(one, tmp_path, capsys):
    name = one.files[0]
    data = one.data[name]
    head_end = 8 + struct.unpack("<Q", data[:8])[0]
    cases = [
        (f"rank flip at {pos}", None, {name: b}, [])
        for pos, b in _flips(data, [(0, head_end), (head_end, len(data))], 64, seed=5)
    ]
    cases += [
        (f"root flip at {pos}", b, None, []) for pos, b in _flips(one.root, [(0, len(one.root))], 12, 6)
    ]
    cuts = sorted({0, 4, 7, 8, 9, head_end - 1, head_end, *(round(i * len(data) / 6) for i in range(1, 6))})
    for cut in cuts:
        cases.append((f"cut at {cut}", None, {name: data[:cut]}, []))
        root = _root_claims(one, bytes=cut)  # the size claim agreeing: the reader sees the rest
        cases.append((f"cut at {cut}, size claimed", root, {name: data[:cut]}, []))
    wrong = []
    counts = _run(
        cases, one, tmp_path, capsys, wrong, allow_same={c[0] for c in cases if "flip" in c[0]}, full=False
    )
    assert not wrong, "\n".join(wrong)
    print(
        f"per-rank bit flips: 64 in the rank file ({head_end} header bytes, {len(data) - head_end} data), "
        f"12 in the root; truncations at {len(cuts)} offsets, with and without the size claimed: "
        f"{len(cases)} cases, {dict(counts)}"
    )
    assert counts["refused"] >= len(cases) - 6  # a flip in header padding or JSON whitespace loads


# ----------------------------------------------------------------------- two rank files
K = "model/2.weight"  # 131 rows: 66 in rank 0's file, 65 in rank 1's


def _cut(fn):
    """An edit of K's split given as fn(its boundary row) -> new pieces."""

    def edit(h):
        p = h["per_rank"]
        b = p["splits"][p["tensor_splits"][K]][0][2]
        _split_of(K, fn(b))(h)

    return edit


TWO_RANK_EDITS = {
    "files swapped": _index(lambda p: p["files"].reverse()),
    "pieces' files swapped": _cut(lambda b: [[1, 0, b], [0, b, 131]]),
    "boundary moved down": _cut(lambda b: [[0, 0, b - 1], [1, b - 1, 131]]),
    "boundary moved up": _cut(lambda b: [[0, 0, b + 1], [1, b + 1, 131]]),
    "overlap across files": _cut(lambda b: [[0, 0, b], [1, b - 6, 131]]),
    "gap across files": _cut(lambda b: [[0, 0, b - 6], [1, b, 131]]),
    "both pieces in file 0": _cut(lambda b: [[0, 0, b], [0, b, 131]]),
    "second piece dropped": _cut(lambda b: [[0, 0, b]]),
    "a third piece past the rows": _cut(lambda b: [[0, 0, b], [1, b, 131], [1, 131, 140]]),
    "file 1 listed twice": _index(lambda p: p["files"].append(dict(p["files"][1]))),
    "file 1 as rank 0": _index(lambda p: p["files"][1].update(rank=0)),
    "world_size 1": _index(lambda p: p.update(world_size=1)),
    "file 1's manifest sha256 for file 0": _index(
        lambda p: p["files"][1].update(manifest_sha256=p["files"][0]["manifest_sha256"])
    ),
    "K on the split of a 64-row tensor": lambda h: h["per_rank"]["tensor_splits"].update(
        {K: h["per_rank"]["tensor_splits"]["model/0.weight"]}
    ),
}


def test_two_rank_files_edited_are_refused(two, tmp_path, capsys):
    f0, f1 = two.files
    cases = [(name, _with_header(two.root, edit=edit), None, []) for name, edit in TWO_RANK_EDITS.items()]
    # file 1 holding file 0's bytes, the root's claims of it recomputed to match
    entry0 = ck.read_header(two.path)["per_rank"]["files"][0]
    claims = {k: entry0[k] for k in ("bytes", "manifest_sha256")}
    copy_root = _with_header(two.root, edit=_index(lambda p: p["files"][1].update(**claims)))
    cases.append(("file 1 a copy of file 0", copy_root, {f1: two.data[f0]}, []))
    cases.append(("file 1 missing", None, {f1: None}, []))
    cases.append(("file 1 truncated", None, {f1: two.data[f1][:-8]}, []))
    flipped = bytearray(two.data[f1])
    flipped[len(flipped) // 2] ^= 4
    cases.append(("file 1 with a bit flipped", None, {f1: bytes(flipped)}, []))
    cases.append(("a manifest piece of file 1 moved", *_rank_edit(two, 1, **_piece(K, rows=[64, 129])), []))
    wrong = []
    counts = _run(cases, two, tmp_path, capsys, wrong, strict_inspect=False)
    assert not wrong, "\n".join(wrong)
    print(f"two rank files (FSDP2 on 2 gloo ranks) edited: {len(cases)} cases, {dict(counts)}")
    assert counts["refused"] == len(cases)


# ------------------------------------------------------------ files that change mid-read
def test_rank_files_changed_between_the_check_and_the_read(one, tmp_path):
    """The reader checks a rank file's head, then range-reads its rows by path: a file removed,
    cut or replaced by a FIFO in between is a CheckpointError naming the root (ShardMissing,
    which read() retries on a replaced root, for a removed one)."""
    from coatstate.checkpoint.shards import ShardMissing

    d = _case(tmp_path, one, "mid-read")
    url, path = str(d / "ckpt.safetensors"), d / one.files[0]
    changes = {
        "removed": (path.unlink, ShardMissing),
        "cut": (lambda: path.write_bytes(one.data[one.files[0]][:4096]), CheckpointError),
        "a FIFO": (lambda: (path.unlink(), os.mkfifo(path)), CheckpointError),
    }
    for name, (change, error) in changes.items():
        reader = rank_read._Reader(url, ck.read_header(url), verify=True)
        reader.file(0)  # its head checked
        change()
        with _deadline(10, name), pytest.raises(error) as info:
            reader.rows(W, 0, 128)
        assert str(info.value).startswith(url), (name, str(info.value))
        path.unlink(missing_ok=True)
        path.write_bytes(one.data[one.files[0]])


def test_a_reader_rereads_a_per_rank_root_replaced_mid_read(tmp_path, monkeypatch):
    """A per-rank save commits (and removes the old rank files) between this reader's check of
    the old files and its range reads: read() reads the new root."""
    url = str(tmp_path / "r.safetensors")
    first = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(64, 64)}},
        "param_groups": [{"params": [0]}],
    }
    second = {
        "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(64, 64)}},
        "param_groups": [{"params": [0]}],
    }
    ck.save(first, url, distributed="per_rank")
    real, raced = rank_read._read_into, []

    def racing(*args):
        if not raced:
            raced.append(True)
            ck.save(second, url, distributed="per_rank")
        return real(*args)

    monkeypatch.setattr(rank_read, "_read_into", racing)
    assert ck.read(url).optimizer["state"][0]["step"].item() == 2.0 and raced
