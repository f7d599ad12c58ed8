"""Which files a save removes: one rule on every filesystem (local, memory://, s3 through moto).

A save removes only the shards of the root it replaces: names with its stem and that root's save
id, whose own metadata names the same id. Nothing is found by a name pattern, so a root that
names another checkpoint's files (copied or crafted), a renamed root, and another save's temp
files never lose anything (issue 48's defects 3 and 11).
"""

from __future__ import annotations

import os
import threading
import uuid

import fsspec
import pytest
import torch
from coatstate.formats.schema import CheckpointError

from coatstate.checkpoint import api as ck
from coatstate.checkpoint import container, encoding

SHARD = 8_000
"""Bytes per shard: the states below make two or three shards."""


def _state(value: float) -> dict:
    t = torch.full((32, 32), value)
    return {
        "state": {0: {"step": torch.tensor(value), "exp_avg": t, "exp_avg_sq": t}},
        "param_groups": [{"params": [0]}],
    }


def _files(directory: str) -> set[str]:
    fs, path = fsspec.core.url_to_fs(directory)
    fs.invalidate_cache(path)
    try:
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=True) if e["type"] == "file"
        }
    except FileNotFoundError:
        return set()


def _copy(directory: str, src: str, dst: str) -> None:
    fs, path = fsspec.core.url_to_fs(directory)
    fs.invalidate_cache(path)
    fs.cp_file(f"{path}/{src}", f"{path}/{dst}")


def _named(url: str) -> set[str]:
    return {s["file"] for s in ck.read_header(url)["shards"] or []}


def _assert_only_the_root_and_its_files(directory: str, url: str) -> None:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    stem = name.removesuffix(".safetensors")
    mine = {n for n in _files(directory) if n.startswith((stem, "." + stem))}
    assert mine == {name, *_named(url)}, f"left: {sorted(mine - {name, *_named(url)})}"


def _crafted_root(url: str, header: dict, first_shard: str) -> None:
    """A root whose header (with a valid checksum) names `first_shard` as its first shard."""
    header["shards"][0]["file"] = first_shard
    meta = encoding.metadata(header)
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "wb") as f:
        container.write_safetensors(f, {}, meta)


def _ownership_rule(directory: str) -> None:
    ckpt, best, evil = (f"{directory}/{n}.safetensors" for n in ("ck", "best", "evil"))
    ck.save(_state(1.0), ckpt, shard_size=SHARD)
    assert len(_named(ckpt)) >= 2
    # a root copied alone under another name: a save over the copy keeps the original's shards
    _copy(directory, "ck.safetensors", "best.safetensors")
    ck.save(_state(2.0), best, shard_size=SHARD)
    assert ck.read(ckpt).optimizer["state"][0]["step"].item() == 1.0
    assert ck.read(best).optimizer["state"][0]["step"].item() == 2.0
    # a crafted root (valid checksum) that names best.safetensors: a save over it deletes nothing of best
    _crafted_root(evil, ck.read_header(ckpt), "best.safetensors")
    with pytest.raises(CheckpointError):
        ck.read(evil)  # (it passes the header checks; its "shard" is no shard of its save)
    ck.save(_state(3.0), evil, shard_size=SHARD)
    assert ck.read(best).optimizer["state"][0]["step"].item() == 2.0
    assert ck.read(ckpt).optimizer["state"][0]["step"].item() == 1.0
    # and the save's own stem is still cleaned: a save over each root leaves only its files
    for url, value in ((ckpt, 4.0), (best, 5.0), (evil, 6.0)):
        ck.save(_state(value), url, shard_size=SHARD)
        assert ck.read(url).optimizer["state"][0]["step"].item() == value
    _assert_only_the_root_and_its_files(directory, ckpt)
    _assert_only_the_root_and_its_files(directory, best)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_save_removes_only_files_of_its_stem_that_name_its_save(kind, tmp_path):
    directory = str(tmp_path) if kind == "local" else f"memory://coatstate-own/{uuid.uuid4().hex}"
    _ownership_rule(directory)


def test_the_same_rule_on_s3(s3_bucket):
    _ownership_rule(f"{s3_bucket}/{uuid.uuid4().hex}")


def test_concurrent_sharded_saves_lose_nothing(tmp_path):
    """Saves racing to one URL: the last commit wins and its root loads; a loser's shards may stay
    (nothing removes files by pattern), but no save removes a shard the current root names."""
    url = str(tmp_path / "c.safetensors")
    errors = []

    def saving(value: float):
        try:
            for i in range(4):
                ck.save(_state(value + i), url, shard_size=SHARD)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=saving, args=(v,)) for v in (10.0, 20.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert ck.read(url).optimizer["state"][0]["step"].item() in (13.0, 23.0)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp file


# ------------------------------------------ issue 48, defects 3 and 11: gone by design
def test_a_renamed_sharded_root_keeps_its_shards(tmp_path):
    """Defect 3: after `mv ck.safetensors best.safetensors` the next save to ck.safetensors used
    to delete every ck-* shard its new root did not name, best's included."""
    ckpt, best = tmp_path / "ck.safetensors", tmp_path / "best.safetensors"
    ck.save(_state(1.0), ckpt, shard_size=SHARD)
    os.rename(ckpt, best)
    ck.save(_state(2.0), ckpt, shard_size=SHARD)
    ck.save(_state(3.0), ckpt, shard_size=SHARD)
    assert ck.read(best).optimizer["state"][0]["step"].item() == 1.0
    assert ck.read(ckpt).optimizer["state"][0]["step"].item() == 3.0


def test_a_renamed_per_rank_checkpoint_loads_and_survives_the_next_save(tmp_path):
    """Defect 3, per-rank: a per-rank checkpoint is one directory, so a rename takes every file."""
    ckpt, best = tmp_path / "ck", tmp_path / "best"
    ck.save(_state(1.0), ckpt, distributed="per_rank")
    os.rename(ckpt, best)
    assert ck.read(best).optimizer["state"][0]["step"].item() == 1.0  # at once
    ck.save(_state(2.0), ckpt, distributed="per_rank")
    ck.save(_state(3.0), ckpt, distributed="per_rank")
    assert ck.read(best).optimizer["state"][0]["step"].item() == 1.0
    assert ck.read(ckpt).optimizer["state"][0]["step"].item() == 3.0


@pytest.mark.parametrize("layout", ["single", "sharded", "per_rank"])
def test_a_save_leaves_another_checkpoints_temp_file_alone(tmp_path, layout):
    """Defect 11: a save of ck.safetensors took `.ck-20240101-00001-of-00001.safetensors.tmp-*`
    (the temp file of a save of ck-20240101-00001-of-00001.safetensors, whose name looks like a
    shard of ck) for its own and deleted it mid-write."""
    other = tmp_path / ".ck-20240101-00001-of-00001.safetensors.tmp-0123456789ab"
    other.write_bytes(b"another save, still writing")
    shard = tmp_path / "ck-20240101-00001-of-00001.safetensors"  # and a finished one of that name
    ck.save(_state(0.5), shard)
    options = {"sharded": {"shard_size": SHARD}, "per_rank": {"distributed": "per_rank"}}.get(layout, {})
    url = tmp_path / ("ck" if layout == "per_rank" else "ck.safetensors")
    for value in (1.0, 2.0):
        ck.save(_state(value), url, **options)
    assert other.read_bytes() == b"another save, still writing"
    assert ck.read(shard).optimizer["state"][0]["step"].item() == 0.5
    assert ck.read(url).optimizer["state"][0]["step"].item() == 2.0


def test_a_per_rank_read_rereads_when_a_newer_save_removes_its_version(tmp_path, monkeypatch):
    from coatstate.checkpoint import dcp

    url = tmp_path / "ck"
    ck.save(_state(1.0), url, distributed="per_rank")
    real, raced = dcp.read_flat, []

    def racing(path, fail):
        if not raced:
            raced.append(path)
            ck.save(_state(2.0), url, distributed="per_rank")  # commits, then removes `path`
        return real(path, fail)

    monkeypatch.setattr(dcp, "read_flat", racing)
    assert ck.read(url).optimizer["state"][0]["step"].item() == 2.0
    assert not os.path.exists(raced[0])
