"""Which files a save removes: one rule on every filesystem (local, memory://, s3 through moto).

A save removes only files whose name has its stem and whose own metadata names the save id it
replaces (or its own); a root that names another checkpoint's files, copied or crafted, never
makes a save delete them. Concurrent sharded saves leave only the winning root's files.
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
from coatstate.checkpoint import container, encoding, shards

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


@pytest.fixture(scope="module")
def s3_directory():
    """A bucket on moto's S3 server, reached through s3fs (skipped without either)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("flask")  # (moto's server needs it: the moto[server] extra)
    import s3fs

    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        old = fsspec.config.conf.get("s3")
        fsspec.config.conf["s3"] = opts
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("coatstate-own")
        yield "s3://coatstate-own"
    finally:
        if old is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = old
        server.stop()


def test_the_same_rule_on_s3(s3_directory):
    _ownership_rule(f"{s3_directory}/{uuid.uuid4().hex}")


def test_concurrent_sharded_saves_leave_only_the_winners_shards(tmp_path, monkeypatch):
    """W1 commits A; while W1's cleanup runs (its root read done), W2 saves B in full. Then only
    B's root and shards remain: A's shards go with B's cleanup, not with some later save."""
    url = str(tmp_path / "c.safetensors")
    real, w2_done, w1_paused = shards._root_shards, threading.Event(), threading.Event()

    def slow_first_cleanup(root_url):
        found = real(root_url)
        if threading.current_thread().name == "W1" and found and not w1_paused.is_set():
            w1_paused.set()  # W1 has committed and is reading the root in its cleanup
            assert w2_done.wait(30)
        return found

    monkeypatch.setattr(shards, "_root_shards", slow_first_cleanup)
    errors = []

    def saving(value: float, after: threading.Event | None, done: threading.Event | None):
        try:
            if after is not None:
                assert after.wait(30)
            ck.save(_state(value), url, shard_size=SHARD)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
        finally:
            if done is not None:
                done.set()

    w1 = threading.Thread(target=saving, args=(1.0, None, None), name="W1")
    w2 = threading.Thread(target=saving, args=(2.0, w1_paused, w2_done), name="W2")
    w1.start()
    w2.start()
    w1.join(60)
    w2.join(60)
    assert not errors, errors
    assert w1_paused.is_set()
    assert ck.read(url).optimizer["state"][0]["step"].item() == 2.0
    _assert_only_the_root_and_its_files(str(tmp_path), url)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no marker, no temp file
