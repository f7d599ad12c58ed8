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

import os
import struct
import sys

import pytest
import torch
from coatstate.formats.schema import CheckpointError
from per_rank_harness import (
    Saved,
    big_target,
    case_dir,
    deep,
    file0_edit,
    flips,
    index_edit,
    rank_edit,
    run_cases,
    small_model,
    small_target,
    small_train,
    split_edit,
    two_rank_worker,
)
from test_hostile_input import _deadline, _with_header

from coatstate import checkpoint as ck
from coatstate.checkpoint import container, rank_files, rank_read
from coatstate.optim import CompressedAdamW

# ------------------------------------------------------------------------------ the targets


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """A world of one (no process group): one rank file holding every row."""
    base = tmp_path_factory.mktemp("per_rank_one")
    model = small_model()
    opt = CompressedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    small_train(model, opt, 2, seed=1)
    ck.save(opt, str(base / "ckpt.safetensors"), model=model, distributed="per_rank")
    return Saved(base, small_target)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """FSDP2 on 2 gloo ranks: two rank files, each tensor's rows cut between them."""
    if not torch.distributed.is_available() or sys.platform == "win32":
        pytest.skip("needs torch.distributed with gloo")
    from test_distributed_checkpoint import _start

    base = tmp_path_factory.mktemp("per_rank_two")
    _start(two_rank_worker, 2, str(base))
    return Saved(base, big_target)


# -------------------------------------------------------------------------------- root edits


def _huge(key: str, rows: int):
    """A shape claim of `rows` rows for `key`, with a split that covers them: no file backs it."""

    def edit(h):
        h["tensors"][key]["shape"][0] = rows
        split_edit(key, [[0, 0, rows]])(h)

    return edit


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
        "files an object": index_edit(lambda p: p.update(files={"0": p["files"][0]})),
        "files a string": index_edit(lambda p: p.update(files="ckpt")),
        "files entry a string": index_edit(lambda p: p["files"].__setitem__(0, p["files"][0]["file"])),
        "files entry a list": index_edit(lambda p: p["files"].__setitem__(0, list(p["files"][0].values()))),
        "files empty": index_edit(lambda p: p.update(files=[])),
        "no rank": index_edit(lambda p: p["files"][0].pop("rank")),
        "rank -1": file0_edit(rank=-1),
        "rank a string": file0_edit(rank="0"),
        "world_size 0": index_edit(lambda p: p.update(world_size=0)),
        "world_size true": index_edit(lambda p: p.update(world_size=True)),
        "save_id a number": index_edit(lambda p: p.update(save_id=12345678)),
        "save_id another": index_edit(lambda p: p.update(save_id="00000000")),
        "duplicate file entry": index_edit(lambda p: p["files"].append(dict(p["files"][0]))),
        "duplicate file, rank 1": index_edit(lambda p: p["files"].append({**p["files"][0], "rank": 1})),
        "with shards": lambda h: h.update(shards=[]),
        "with compression": lambda h: h.update(compression="zstd"),
        "nested 100 deep": _text_before_world_size(f'"x":{deep(100)},'),
        "nested 10**5 deep": _text_before_world_size(f'"x":{deep(10**5)},'),
        "duplicate key": _text_before_world_size('"world_size":2,'),
        "splits an object": index_edit(lambda p: p.update(splits={})),
        "tensor_splits a list": index_edit(lambda p: p.update(tensor_splits=[])),
        "tensor_splits missing a key": index_edit(lambda p: p["tensor_splits"].pop(W)),
        "tensor_splits extra key": index_edit(lambda p: p["tensor_splits"].update({"model/x": 0})),
        "tensor_splits 99": index_edit(lambda p: p["tensor_splits"].update({W: 99})),
        "tensor_splits -1": index_edit(lambda p: p["tensor_splits"].update({W: -1})),
        "tensor_splits a string": index_edit(lambda p: p["tensor_splits"].update({W: "1"})),
        "tensor_splits 1.0": index_edit(lambda p: p["tensor_splits"].update({W: 1.0})),
        "tensor split of another shape": index_edit(lambda p: p["tensor_splits"].update({W: 2})),
        "step on a 128-row split": index_edit(lambda p: p["tensor_splits"].update({"state/0/step": 1})),
    },
    "names": {
        "../ name": file0_edit(file="../x/ckpt-{id}-rank00000-of-00001.safetensors"),
        "./ name": file0_edit(file="./ckpt-{id}-rank00000-of-00001.safetensors"),
        "sub/../ name": file0_edit(file="sub/../ckpt-{id}-rank00000-of-00001.safetensors"),
        "..\\ name": file0_edit(file="..\\ckpt-{id}-rank00000-of-00001.safetensors"),
        "absolute name": file0_edit(file="{outside}/ckpt-{id}-rank00000-of-00001.safetensors"),
        "file:// name": file0_edit(file="file://{outside}/ckpt-{id}-rank00000-of-00001.safetensors"),
        "memory:// name": file0_edit(file="memory://ckpt-{id}-rank00000-of-00001.safetensors"),
        "s3:// name": file0_edit(file="s3://bucket/ckpt-{id}-rank00000-of-00001.safetensors"),
        "NUL in name": file0_edit(file="ckpt-{id}-rank00000-of-00001.safetensors\x00"),
        "newline in name": file0_edit(file="ckpt-{id}-rank00000-of-00001.safetensors\n"),
        "a number as name": file0_edit(file=7),
        "null name": file0_edit(file=None),
        "another stem": file0_edit(file="other-{id}-rank00000-of-00001.safetensors"),
        "another save id": file0_edit(file="ckpt-0badc0de-rank00000-of-00001.safetensors"),
        "a temp file": file0_edit(file="ckpt-{id}-rank00000-of-00001.safetensors.tmp-0123456789ab"),
        "a hidden file": file0_edit(file=".ckpt-{id}-rank00000-of-00001.safetensors"),
        "the root itself": file0_edit(file="ckpt.safetensors"),
    },
    "row ranges": {
        "overlap": split_edit(W, [[0, 0, 64], [0, 32, 128]]),
        "gap": split_edit(W, [[0, 0, 64], [0, 65, 128]]),
        "past the rows": split_edit(W, [[0, 0, 200]]),
        "short of the rows": split_edit(W, [[0, 0, 100]]),
        "negative start": split_edit(W, [[0, -1, 128]]),
        "float stop": split_edit(W, [[0, 0, 128.0]]),
        "bool start": split_edit(W, [[0, False, 128]]),
        "strings": split_edit(W, [["0", "0", "128"]]),
        "a pair": split_edit(W, [[0, 128]]),
        "four numbers": split_edit(W, [[0, 0, 128, 0]]),
        "file index 1": split_edit(W, [[1, 0, 128]]),
        "file index -1": split_edit(W, [[-1, 0, 128]]),
        "file index true": split_edit(W, [[True, 0, 128]]),
        "empty piece first": split_edit(W, [[0, 0, 0], [0, 0, 128]]),
        "reversed": split_edit(W, [[0, 128, 0]]),
        "out of order": split_edit(W, [[0, 64, 128], [0, 0, 64]]),
        "split an object": split_edit(W, {"0": [0, 0, 128]}),
        "piece an object": split_edit(W, [{"file": 0, "start": 0, "stop": 128}]),
        "no pieces": split_edit(W, []),
        "2**64 rows": split_edit(W, [[0, 0, 2**64]]),
        "cut in two in one file": split_edit(W, [[0, 0, 64], [0, 64, 128]]),
    },
    "sizes": {
        "bytes 2**62": file0_edit(bytes=2**62),
        "bytes one short": index_edit(lambda p: p["files"][0].update(bytes=p["files"][0]["bytes"] - 1)),
        "bytes one more": index_edit(lambda p: p["files"][0].update(bytes=p["files"][0]["bytes"] + 1)),
        "bytes -1": file0_edit(bytes=-1),
        "bytes a float": file0_edit(bytes=57184.0),
        "bytes a string": file0_edit(bytes="57184"),
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
        "manifest sha256 zeros": file0_edit(manifest_sha256="0" * 64),
        "manifest sha256 upper case": lambda h: h["per_rank"]["files"][0].update(
            manifest_sha256=h["per_rank"]["files"][0]["manifest_sha256"].upper()
        ),
        "manifest sha256 a number": file0_edit(manifest_sha256=0),
        "no manifest sha256": index_edit(lambda p: p["files"][0].pop("manifest_sha256")),
        "a zstd encoding": lambda h: h["tensors"][W].update(encoding="zstd", stored_bytes=16384),
        "a zstd encoding of the step": lambda h: h["tensors"]["state/0/step"].update(
            encoding="zstd", stored_bytes=4
        ),
        "a step of 0 rows": lambda h: (
            h["tensors"]["state/0/step"].update(shape=[0]),
            split_edit("state/0/step", [])(h),
        ),
        "a step of 2 rows": lambda h: (
            h["tensors"]["state/0/step"].update(shape=[2]),
            split_edit("state/0/step", [[0, 0, 2]])(h),
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
        counts[cls] = run_cases(
            cases, one, tmp_path, capsys, wrong, strict_inspect=cls != "dtypes and checksums"
        )
    assert not wrong, "\n".join(wrong)
    print(
        "per-rank root edits with the header checksum recomputed: "
        + ", ".join(f"{cls} {sum(c.values())} {dict(c)}" for cls, c in counts.items())
    )
    assert all(c["refused"] == len(ROOT_EDITS[cls]) for cls, c in counts.items())


# -------------------------------------------------------------------- what the rank file is
def _root_claims(saved: Saved, **kw) -> bytes:
    """The root with rank file 0's entry changed (its size claim, its manifest sha256)."""
    return _with_header(saved.root, edit=file0_edit(**kw))


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
    counts = run_cases(cases, one, tmp_path, capsys, wrong)
    assert not wrong, "\n".join(wrong)
    print(f"rank file 0 missing, a FIFO, a directory, empty, a symlink: {len(cases)} cases, {dict(counts)}")
    assert counts["refused"] == len(cases)


# --------------------------------------------------------- rank file edits, root recomputed


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
    "manifest 100 deep": dict(manifest_text=lambda t: t[:-1] + ',"x":' + deep(100) + "}"),
    "manifest 10**5 deep": dict(manifest_text=lambda t: t[:-1] + ',"x":' + deep(10**5) + "}"),
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
        root, files = rank_edit(one, **edit)
        cases.append((name, root, files, []))
    wrong = []
    # appended bytes no piece points at are harmless (the root's size claim covers them)
    counts = run_cases(
        cases, one, tmp_path, capsys, wrong, strict_inspect=False, allow_same={"4 KiB appended"}
    )
    assert not wrong, "\n".join(wrong)
    print(f"rank file edits, the root's size and manifest sha256 recomputed: {len(cases)}, {dict(counts)}")
    assert counts["refused"] >= len(cases) - 1


# ------------------------------------------------------------------ bit flips, truncations


def test_bit_flips_and_truncations_are_refused_or_harmless(one, tmp_path, capsys):
    name = one.files[0]
    data = one.data[name]
    head_end = 8 + struct.unpack("<Q", data[:8])[0]
    cases = [
        (f"rank flip at {pos}", None, {name: b}, [])
        for pos, b in flips(data, [(0, head_end), (head_end, len(data))], 64, seed=5)
    ]
    cases += [(f"root flip at {pos}", b, None, []) for pos, b in flips(one.root, [(0, len(one.root))], 12, 6)]
    cuts = sorted({0, 4, 7, 8, 9, head_end - 1, head_end, *(round(i * len(data) / 6) for i in range(1, 6))})
    for cut in cuts:
        cases.append((f"cut at {cut}", None, {name: data[:cut]}, []))
        root = _root_claims(one, bytes=cut)  # the size claim agreeing: the reader sees the rest
        cases.append((f"cut at {cut}, size claimed", root, {name: data[:cut]}, []))
    wrong = []
    counts = run_cases(
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
        split_edit(K, fn(b))(h)

    return edit


TWO_RANK_EDITS = {
    "files swapped": index_edit(lambda p: p["files"].reverse()),
    "pieces' files swapped": _cut(lambda b: [[1, 0, b], [0, b, 131]]),
    "boundary moved down": _cut(lambda b: [[0, 0, b - 1], [1, b - 1, 131]]),
    "boundary moved up": _cut(lambda b: [[0, 0, b + 1], [1, b + 1, 131]]),
    "overlap across files": _cut(lambda b: [[0, 0, b], [1, b - 6, 131]]),
    "gap across files": _cut(lambda b: [[0, 0, b - 6], [1, b, 131]]),
    "both pieces in file 0": _cut(lambda b: [[0, 0, b], [0, b, 131]]),
    "second piece dropped": _cut(lambda b: [[0, 0, b]]),
    "a third piece past the rows": _cut(lambda b: [[0, 0, b], [1, b, 131], [1, 131, 140]]),
    "file 1 listed twice": index_edit(lambda p: p["files"].append(dict(p["files"][1]))),
    "file 1 as rank 0": index_edit(lambda p: p["files"][1].update(rank=0)),
    "world_size 1": index_edit(lambda p: p.update(world_size=1)),
    "file 1's manifest sha256 for file 0": index_edit(
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
    copy_root = _with_header(two.root, edit=index_edit(lambda p: p["files"][1].update(**claims)))
    cases.append(("file 1 a copy of file 0", copy_root, {f1: two.data[f0]}, []))
    cases.append(("file 1 missing", None, {f1: None}, []))
    cases.append(("file 1 truncated", None, {f1: two.data[f1][:-8]}, []))
    flipped = bytearray(two.data[f1])
    flipped[len(flipped) // 2] ^= 4
    cases.append(("file 1 with a bit flipped", None, {f1: bytes(flipped)}, []))
    cases.append(("a manifest piece of file 1 moved", *rank_edit(two, 1, **_piece(K, rows=[64, 129])), []))
    wrong = []
    counts = run_cases(cases, two, tmp_path, capsys, wrong, strict_inspect=False)
    assert not wrong, "\n".join(wrong)
    print(f"two rank files (FSDP2 on 2 gloo ranks) edited: {len(cases)} cases, {dict(counts)}")
    assert counts["refused"] == len(cases)


# ------------------------------------------------------------ files that change mid-read
def test_rank_files_changed_between_the_check_and_the_read(one, tmp_path):
    """The reader checks a rank file's head, then range-reads its rows by path: a file removed,
    cut or replaced by a FIFO in between is a CheckpointError naming the root (ShardMissing,
    which read() retries on a replaced root, for a removed one)."""
    from coatstate.checkpoint.shards import ShardMissing

    d = case_dir(tmp_path, one, "mid-read")
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
            ck.wait_for_saves()  # (the old rank files go on a thread after the commit)
        return real(*args)

    monkeypatch.setattr(rank_read, "_read_into", racing)
    assert ck.read(url).optimizer["state"][0]["step"].item() == 2.0 and raced
