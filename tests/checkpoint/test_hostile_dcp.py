"""Hostile torch.distributed.checkpoint directories: pickle payloads, path traversal, short
chunks, size claims. Each is refused with CheckpointError before any data is trusted (split from
test_hostile_input.py, whose helpers it shares)."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from coatstate import checkpoint as ck
from coatstate.checkpoint import dcp as dcp_reader
from coatstate.cli import main as cli
from coatstate.optim import CompressedAdamW
from tests.checkpoint.test_hostile_input import Target, _bits, _Boom, _deadline, _model, _train


# ------------------------------------------------------------------------ DCP directories
def _dcp_dir(path, seed: int = 0):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(seed)
    opt = CompressedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=seed + 1)
    msd, osd = get_state_dict(model, opt)
    import warnings

    with warnings.catch_warnings():  # "torch.distributed is disabled ... a single process": meant
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)
    return _bits(opt.state_dict()), _bits(model.state_dict())


def _metadata(path):
    return dcp_reader._read_dcp_metadata((path / ".metadata").read_bytes(), str(path))


def _write_metadata(path, md) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _edit_md(fn):
    def change(path):
        md = _metadata(path)
        fn(md, path)
        _write_metadata(path, md)

    return change


def _first(md, kind="tensor", name=None):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for fqn, v in md.state_dict_metadata.items():
        if (kind == "tensor") == isinstance(v, TensorStorageMetadata) and (name is None or name in fqn):
            return fqn, v
    raise AssertionError(kind)


def _info(md, fqn, offsets=None):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return md.storage_data[MetadataIndex(fqn, offsets)]


def _set_info(md, fqn, offsets, **changes):
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex

    key = next(k for k in md.storage_data if k == MetadataIndex(fqn, offsets))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], **changes)


def _drop_chunk_half(md, path):
    _, v = _first(md, name="0.weight")
    v.size = torch.Size([v.size[0] * 2, *v.size[1:]])  # claims rows that no chunk holds


def _huge_claim(md, path):
    _, v = _first(md, name="0.weight")
    v.size = v.chunks[0].sizes = torch.Size([2**16, 2**15])  # 8 GiB of float32 from a 100 kB file


def _overlap(md, path):
    """Rows [0, h + 1) and [h, n - 1): as many elements as the tensor, one row twice, one never."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex

    fqn, v = _first(md, name="0.weight")
    n, h, rest = v.size[0], v.size[0] // 2, list(v.size[1:])
    a = dataclasses.replace(v.chunks[0], sizes=torch.Size([h + 1, *rest]))
    b = dataclasses.replace(v.chunks[0], offsets=torch.Size([h, 0]), sizes=torch.Size([n - 1 - h, *rest]))
    info = _info(md, fqn, v.chunks[0].offsets)
    v.chunks = [a, b]
    md.storage_data[MetadataIndex(fqn, b.offsets)] = dataclasses.replace(info, offset=0, length=1)


def _payload_item(md, path):
    info = _info(md, _first(md, kind="bytes")[0])
    with open(path / os.fspath(info.relative_path), "r+b") as f:
        f.seek(info.offset)
        blob = pickle.dumps(_Boom())
        f.write(blob + b"\0" * (info.length - len(blob)))


class _Call:
    """Pickles as a call of an allowed global with bad arguments."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _write(name: str, make):
    return lambda p: (p / name).write_bytes(make(p))


def _storage_info():
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def _chunk0(md):
    fqn, v = _first(md, name="0.weight")
    return fqn, v.chunks[0].offsets


def _replace_data_file(p, make) -> None:
    name = next(n for n in os.listdir(p) if n.endswith(".distcp"))
    os.unlink(p / name)
    make(p / name)


_META = ".metadata"
# name: (how the good directory is broken, what the refusal says, refused before any data is read)
# fmt: off
DCP_CASES = {
    ".metadata pickle payload": (_write(_META, lambda p: pickle.dumps(_Boom())), "refusing to", True),
    ".metadata os.system": (_write(_META, lambda p: pickle.dumps(os.system)), "refusing to unpickle", True),
    "value pickle payload": (_edit_md(_payload_item), "weights_only", False),
    "torch.Size(5)": (_write(_META, lambda p: pickle.dumps(_Call(torch.Size, 5))), "TypeError", True),
    "_get_layout('x')": (_write(_META, lambda p: pickle.dumps(_Call(torch.serialization._get_layout, "x"))),
                         "KeyError", True),
    "_StorageInfo()": (_write(_META, lambda p: pickle.dumps(_Call(_storage_info()))), "TypeError", True),
    "OrderedDict(5)": (_write(_META, lambda p: pickle.dumps(_Call(__import__("collections").OrderedDict, 5))),
                       "TypeError", True),
    "truncated .metadata": (_write(_META, lambda p: (p / _META).read_bytes()[:100]), "truncated", True),
    "a list as metadata": (_write(_META, lambda p: pickle.dumps([1, 2])), "not DCP's Metadata", True),
    "traversal ../../x": (_edit_md(lambda md, p: _set_info(md, *_chunk0(md), relative_path="../../x")),
                          "not a file inside the directory", True),
    "absolute path": (_edit_md(lambda md, p: _set_info(md, *_chunk0(md), relative_path="/etc/hostname")),
                      "not a file inside the directory", True),
    "symlink out": (lambda p: _replace_data_file(p, lambda f: os.symlink("/etc/hostname", f)),
                    "outside the directory", True),
    "short chunks": (_edit_md(_drop_chunk_half), "do not cover it", True),
    "overlapping chunks": (_edit_md(_overlap), "overlap", True),
    "8 GiB claim": (_edit_md(_huge_claim), "needs at least 8589934592 bytes", True),
    "bytes past the file": (_edit_md(lambda md, p: _set_info(md, *_chunk0(md), length=10**9)),
                            "truncated or corrupt", True),
    "shared bytes": (_edit_md(lambda md, p: _set_info(md, *_chunk0(md), offset=0)), "share bytes", True),
    "transforms": (_edit_md(lambda md, p: _set_info(md, *_chunk0(md), transform_descriptors=["zstd"])),
                   "transforms", True),
    "a FIFO as data file": (lambda p: _replace_data_file(p, os.mkfifo), "not a regular file", True),
    "no .metadata": (lambda p: os.unlink(p / _META), "without .metadata", True),
}
# fmt: on


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_hostile_dcp_directories(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COATSTATE_BOOM_DIR", str(tmp_path / "boom"))
    good = tmp_path / "good"
    opt_bits, model_bits = _dcp_dir(good)
    got = ck.read(str(good))
    assert _bits(got.model) == model_bits and _bits(got.optimizer)["state"] == opt_bits["state"]
    reads = []
    real_load = dcp_reader._load_slice
    monkeypatch.setattr(dcp_reader, "_load_slice", lambda *a: reads.append(1) or real_load(*a))
    target = Target()
    for name, (change, why, before_reading) in DCP_CASES.items():
        bad = tmp_path / name.replace(" ", "_")
        shutil.copytree(good, bad)
        change(bad)
        with _deadline(20, name):
            reads.clear()
            message = target.refuses(bad)
            # refused by its metadata: no tensor allocated, no data read
            assert why in message and (not reads or not before_reading), (name, message)
            capsys.readouterr()
            out = tmp_path / "out.safetensors"
            assert cli(["convert", str(bad), str(out)]) == 1, name
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err and not out.exists(), (name, err)
    assert not (tmp_path / "boom").exists()
    print(
        f"hostile DCP directories: {len(DCP_CASES)}, all refused, {sum(c[2] for c in DCP_CASES.values())} "
        "before reading any data"
    )


def test_dcp_chunks_are_assembled(tmp_path):
    """A tensor written as two chunks (two ranks' rows) reads back whole."""
    good = tmp_path / "good"
    _dcp_dir(good)
    md = _metadata(good)
    fqn, v = _first(md, name="0.weight")
    full = ck.read(str(good)).model["0.weight"]
    rows = v.size[0] // 2 + 3
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex

    parts = [(0, full[:rows]), (rows, full[rows:])]
    chunks = []
    for i, (start, part) in enumerate(parts):
        name = f"__rank{i}.distcp"
        torch.save(part.clone(), good / name)
        chunk = dataclasses.replace(v.chunks[0], offsets=torch.Size([start, 0]), sizes=part.shape)
        chunks.append(chunk)
        info = dataclasses.replace(_info(md, fqn, v.chunks[0].offsets), relative_path=name, offset=0)
        md.storage_data[MetadataIndex(fqn, chunk.offsets)] = dataclasses.replace(
            info, length=(good / name).stat().st_size
        )
    v.chunks = chunks
    _write_metadata(good, md)
    assert torch.equal(ck.read(str(good)).model["0.weight"], full)
