"""coatstate.checkpoint.remove_unreferenced and `coatstate clean`: what killed saves leave next to a
root goes, and nothing else; after_commit off local filesystems; per-rank argument checks.

Killed saves are simulated, in one process: a save to a scratch directory makes rank files and
shards carrying their own save ids (as a save killed before its commit leaves them), copied next to
the root; temp files and markers are written by hand under the names the writers give them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import fsspec
import pytest
import torch
from coatstate.formats.schema import CheckpointError
from test_checkpoint import _assert_same

from coatstate import checkpoint as ck
from coatstate.checkpoint import rank_cleanup, rank_files, shards
from coatstate.cli.main import main
from coatstate.optim import CompressedAdamW


def _trained(seed: int = 0) -> tuple[torch.nn.Module, CompressedAdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 32)
    opt = CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)  # FP8 moments for both
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    return model, opt


def _directory(kind: str, tmp_path, what: str) -> str:
    if kind == "local":
        os.makedirs(tmp_path / what, exist_ok=True)
        return str(tmp_path / what)
    return f"memory://coatstate-clean/{uuid.uuid4().hex}/{what}"


def _files(directory: str) -> set[str]:
    fs, path = fsspec.core.url_to_fs(directory)
    fs.invalidate_cache(path)
    try:
        return {os.path.basename(e["name"]) for e in fs.ls(path, detail=True) if e["type"] == "file"}
    except FileNotFoundError:
        return set()


def _put(directory: str, name: str, data: bytes = b"partial") -> str:
    with fsspec.open(f"{directory}/{name}", "wb") as f:
        f.write(data)
    return name


def _copy_in(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the files of a save in `src_dir` other than its root into `dst_dir`."""
    fs, _ = fsspec.core.url_to_fs(dst_dir)
    names = sorted(_files(src_dir) - {"ckpt.safetensors"})
    for name in names:
        fs.cp_file(
            fsspec.core.url_to_fs(f"{src_dir}/{name}")[1], fsspec.core.url_to_fs(f"{dst_dir}/{name}")[1]
        )
    return names


def _killed_saves(directory: str, scratch: str, model, opt) -> list[str]:
    """Leave in `directory` (next to ckpt.safetensors) what killed saves of stem ckpt leave."""
    for sub in ("per_rank", "sharded"):
        fs, path = fsspec.core.url_to_fs(f"{scratch}/{sub}")
        fs.makedirs(path, exist_ok=True)
    ck.save(opt, f"{scratch}/per_rank/ckpt.safetensors", model=model, distributed="per_rank")
    ck.save(opt, f"{scratch}/sharded/ckpt.safetensors", model=model, shard_size=2048)
    strays = _copy_in(f"{scratch}/per_rank", directory) + _copy_in(f"{scratch}/sharded", directory)
    rank_file = next(n for n in strays if "-rank" in n)
    shard = next(n for n in strays if "-of-" in n and "-rank" not in n)
    sid, shard_id = rank_file.split("-")[1], shard.split("-")[1]
    return strays + [
        _put(directory, f".{rank_file}.tmp-{'0' * 12}"),  # killed mid rank file
        _put(directory, f".{shard}.tmp-{'1' * 12}"),  # killed mid shard
        _put(directory, f".ckpt.safetensors.tmp-{'2' * 12}"),  # killed mid root
        _put(directory, f".ckpt-{sid}-rank00000.done", b"{}"),
        _put(directory, f"..ckpt-{sid}-rank00001.done.tmp-{'3' * 12}"),  # killed mid marker
        _put(directory, f".ckpt-{sid}.failed", b"x"),
        _put(directory, f".ckpt-{sid}-rank00002.saving", b""),  # a lock nobody holds any more
        _put(directory, f".ckpt-{shard_id}.saving.tmp-{'4' * 8}", b""),  # killed before its rename
    ]


def _other_stems(directory: str) -> set[str]:
    """Files next to the root that are not the stem ckpt's, or not written by a save."""
    return {
        _put(directory, "ckpt-deadbeef-0badc0de-rank00000-of-00001.safetensors"),  # stem ckpt-deadbeef
        _put(directory, ".ckpt-deadbeef.safetensors.tmp-" + "5" * 12),
        _put(directory, ".other-0badc0de-rank00000-of-00001.safetensors.tmp-" + "6" * 12),
        _put(directory, ".other-0badc0de.failed"),
        _put(directory, "ckpt.safetensors.bak"),
        _put(directory, "ckpt-0badc0de-rank00000-of-00001.safetensors.tmp-" + "7" * 12),  # no dot: not ours
        _put(directory, "notes.txt"),
    }


def _assert_loads(url: str, opt, model) -> None:
    fresh_model, fresh = _trained(seed=1)
    ck.load(fresh, url, model=fresh_model)
    _assert_same(fresh.state_dict(), opt.state_dict(), "optimizer")
    _assert_same(fresh_model.state_dict(), model.state_dict(), "model")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_only_the_files_of_killed_saves_go_and_the_checkpoint_loads(kind, tmp_path):
    directory, scratch = _directory(kind, tmp_path, "run"), _directory(kind, tmp_path, "scratch")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, distributed="per_rank")
    ck.save(opt, f"{directory}/other.safetensors", model=model, distributed="per_rank")
    kept = _files(directory)  # the two roots and their rank files
    strays = _killed_saves(directory, scratch, model, opt)
    kept |= _other_stems(directory)
    assert _files(directory) == kept | set(strays)

    would = ck.remove_unreferenced(url)  # a dry run by default
    assert sorted(os.path.basename(u) for u in would) == sorted(strays)
    assert all(u == f"{directory}/{os.path.basename(u)}" for u in would)
    assert _files(directory) == kept | set(strays)
    assert sorted(ck.remove_unreferenced(url, dry_run=False)) == sorted(would)
    assert _files(directory) == kept
    assert ck.remove_unreferenced(url, dry_run=False) == []
    _assert_loads(url, opt, model)
    _assert_loads(f"{directory}/other.safetensors", opt, model)


def test_a_sharded_root_keeps_its_shards(tmp_path):
    directory, scratch = _directory("local", tmp_path, "run"), _directory("local", tmp_path, "scratch")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, shard_size=2048)
    named = _files(directory)
    assert len(named) > 2  # the root and its shards
    strays = _killed_saves(directory, scratch, model, opt)
    assert sorted(os.path.basename(u) for u in ck.remove_unreferenced(url, dry_run=False)) == sorted(strays)
    assert _files(directory) == named
    _assert_loads(url, opt, model)


def test_cli_lists_with_sizes_and_removes_only_with_yes(tmp_path, capsys):
    directory, scratch = _directory("local", tmp_path, "run"), _directory("local", tmp_path, "scratch")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, distributed="per_rank")
    before = _files(directory)
    strays = _killed_saves(directory, scratch, model, opt)
    rank_file = next(n for n in strays if "-rank" in n and not n.startswith("."))
    size = os.path.getsize(f"{directory}/{rank_file}")
    capsys.readouterr()

    assert main(["clean", url]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and f"{len(strays)} files" in out and "--yes" in out
    assert all(name in out for name in strays)
    assert any(line.split() == [f"{size / 1e3:,.2f}", "kB", rank_file] for line in out.splitlines())
    assert _files(directory) == before | set(strays)

    assert main(["clean", url, "--yes"]) == 0
    assert "removed" in capsys.readouterr().out
    assert _files(directory) == before
    assert main(["clean", url]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    _assert_loads(url, opt, model)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_missing_root_removes_nothing(kind, tmp_path, capsys):
    directory, scratch = _directory(kind, tmp_path, "run"), _directory(kind, tmp_path, "scratch")
    model, opt = _trained()
    strays = _killed_saves(directory, scratch, model, opt)  # a first save, killed before its commit
    url = f"{directory}/ckpt.safetensors"
    with pytest.raises(
        CheckpointError, match=f"no checkpoint there, so nothing is removed; {len(strays)} files"
    ):
        ck.remove_unreferenced(url, dry_run=False)
    assert _files(directory) == set(strays)
    capsys.readouterr()
    assert main(["clean", url, "--yes"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coatstate: error: ") and "by hand" in err and err.count("\n") == 1
    assert _files(directory) == set(strays)
    with pytest.raises(CheckpointError, match="no checkpoint there"):  # (nor any directory)
        ck.remove_unreferenced(f"{_directory(kind, tmp_path, 'empty')}/ckpt.safetensors")


@pytest.mark.parametrize("root", [b"\x00" * 5, b"not a checkpoint at all, but long enough"])
def test_an_unreadable_root_removes_nothing(root, tmp_path, capsys):
    directory, scratch = _directory("memory", tmp_path, "run"), _directory("memory", tmp_path, "scratch")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, distributed="per_rank")
    strays = _killed_saves(directory, scratch, model, opt)
    before = _files(directory)
    _put(directory, "ckpt.safetensors", root)
    with pytest.raises(CheckpointError, match="cannot read the root, so nothing is removed"):
        ck.remove_unreferenced(url, dry_run=False)
    assert main(["clean", url, "--yes"]) == 1
    assert "cannot read the root" in capsys.readouterr().err
    assert _files(directory) == before and set(strays) <= before


def test_a_writer_that_holds_its_lock_keeps_its_files(tmp_path, capsys):
    directory, scratch = _directory("local", tmp_path, "run"), _directory("local", tmp_path, "scratch")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, distributed="per_rank")
    strays = _killed_saves(directory, scratch, model, opt)
    rank_file = next(n for n in strays if "-rank" in n and not n.startswith("."))
    sid = rank_file.split("-")[1]
    lock = shards._SaveLock(url, rank_files.lock_id(sid, 0))  # rank 0 of that save still writes
    try:
        running = {rank_file, f".{rank_file}.tmp-{'0' * 12}", f".ckpt-{sid}-rank00000.done"}
        running |= {
            f".ckpt-{sid}.failed",
            f".ckpt-{sid}-rank00000.saving",
            f".ckpt.safetensors.tmp-{'2' * 12}",
        }
        removed = {os.path.basename(u) for u in ck.remove_unreferenced(url, dry_run=False)}
        assert removed == set(strays) - running
        assert main(["clean", url]) == 0
        out = capsys.readouterr().out
        assert out.count("kept") == len(running) and "holds its lock" in out
    finally:
        lock.release()
    removed = {os.path.basename(u) for u in ck.remove_unreferenced(url, dry_run=False)}
    assert removed == running - {f".ckpt-{sid}-rank00000.saving"}  # (release() removed the marker)
    _assert_loads(url, opt, model)


def test_a_file_its_metadata_does_not_tie_to_its_name_is_kept(tmp_path):
    directory = _directory("local", tmp_path, "run")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, distributed="per_rank")
    (named,) = _files(directory) - {"ckpt.safetensors"}
    renamed = named.replace(named.split("-")[1], "0badc0de")
    fs, _ = fsspec.core.url_to_fs(directory)
    fs.cp_file(f"{directory}/{named}", f"{directory}/{renamed}")
    assert ck.remove_unreferenced(url, dry_run=False) == []
    assert rank_cleanup.sweep(url, dry_run=True).kept == [
        (renamed, "its metadata does not name save 0badc0de")
    ]
    assert renamed in _files(directory)


def test_after_commit_off_local_removes_this_saves_leftover_temps_and_markers(tmp_path, monkeypatch):
    directory = _directory("memory", tmp_path, "run")
    model, opt = _trained()
    url = f"{directory}/ckpt.safetensors"
    ck.save(opt, url, model=model, distributed="per_rank")
    other = _put(directory, f".ckpt-0badc0de-rank00000-of-00001.safetensors.tmp-{'8' * 12}")
    real = rank_files.write_rank_file

    def leaving_a_temp(url, save_id, rank, world_size, pieces):  # as an s3 mv whose delete failed
        report = real(url, save_id, rank, world_size, pieces)
        _put(directory, f".{report['file']}.tmp-{'9' * 12}")
        _put(directory, f"..ckpt-{save_id}-rank00000.done.tmp-{'a' * 12}")
        return report

    monkeypatch.setattr(rank_files, "write_rank_file", leaving_a_temp)
    ck.save(opt, url, model=model, distributed="per_rank", blocking=False).wait()
    ck.wait_for_saves()  # wait() returns at the commit; the replaced save's files go on a thread
    (rank_file,) = (n for n in _files(directory) if n.startswith("ckpt-"))
    assert _files(directory) == {"ckpt.safetensors", rank_file, other}  # another save's stays
    _assert_loads(url, opt, model)


def test_a_per_rank_commit_keeps_a_running_sharded_saves_lock(tmp_path):
    model, opt = _trained()
    url = str(tmp_path / "ckpt.safetensors")
    lock = shards._SaveLock(url, "0badc0de")  # a sharded save to the same URL, still writing
    try:
        ck.save(opt, url, model=model, distributed="per_rank")
        assert ".ckpt-0badc0de.saving" in os.listdir(tmp_path)
    finally:
        lock.release()
    ck.save(opt, url, model=model, distributed="per_rank")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_per_rank_refuses_shard_size_and_zstd_naming_the_fix(tmp_path):
    model, opt = _trained()
    url = str(tmp_path / "ckpt.safetensors")
    with pytest.raises(ValueError, match=r"one file per rank; drop shard_size, or save a single file"):
        ck.save(opt, url, distributed="per_rank", shard_size=2048)
    with pytest.raises(ValueError, match=r"coatstate convert ROOT ONE.safetensors --zstd"):
        ck.save(opt, url, distributed="per_rank", compress="zstd")
    assert os.listdir(tmp_path) == []
    for shard_size in (None, 5 * 2**30):  # no shards asked for / the default
        ck.save(opt, url, model=model, distributed="per_rank", shard_size=shard_size)
    # what the zstd message advises works
    assert main(["convert", url, str(tmp_path / "one.safetensors"), "--zstd"]) == 0
    assert ck.read_header(str(tmp_path / "one.safetensors"))["compression"] == "zstd"


def test_clean_help_imports_no_torch():
    code = textwrap.dedent("""
        import contextlib, io, sys
        from coatstate.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["clean", "--help"]) == 0
        assert "no save to URL is running" in " ".join(out.getvalue().split()), out.getvalue()
        print("torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stdout + done.stderr
