"""coatstate.save(blocking=False): the file equals a blocking save's, the snapshot is taken at the
call (training may go on at once), and a failure is raised at the next save or wait, never lost."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import coatstate
from coatstate.checkpoint import SaveHandle, read, wait_for_saves
from tests.conftest import requires_cuda


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    for _ in range(3):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _tensors(ckpt):
    out = {f"state/{pid}/{k}": v for pid, s in ckpt.optimizer["state"].items() for k, v in s.items()}
    out.update({f"model/{k}": v for k, v in (ckpt.model or {}).items()})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


def test_an_async_save_writes_what_a_blocking_one_writes(tmp_path):
    model, opt = _trained()
    sync, bg = str(tmp_path / "sync.safetensors"), str(tmp_path / "async.safetensors")
    coatstate.save(opt, sync, model=model)
    handle = coatstate.save(opt, bg, model=model, blocking=False)
    assert isinstance(handle, SaveHandle)
    handle.wait()
    assert _same(_tensors(read(sync)), _tensors(read(bg)))


def test_the_snapshot_is_taken_at_the_call(tmp_path):
    model, opt = _trained()
    before = str(tmp_path / "before.safetensors")
    coatstate.save(opt, before, model=model)
    handle = coatstate.save(opt, str(tmp_path / "bg.safetensors"), model=model, blocking=False)
    for _ in range(2):  # training goes on while the file is written
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    handle.wait()
    assert _same(_tensors(read(before)), _tensors(read(str(tmp_path / "bg.safetensors"))))


@pytest.mark.parametrize("next_blocking", [False, True], ids=["then_async", "then_blocking"])
def test_a_failed_background_save_is_raised_at_the_next_save(tmp_path, next_blocking):
    model, opt = _trained()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "x.safetensors"  # its parent is a file
    coatstate.save(opt, str(target), blocking=False)
    nxt = str(tmp_path / "next.safetensors")
    with pytest.raises(RuntimeError, match="background save to .*x.safetensors failed"):
        coatstate.save(opt, nxt, blocking=next_blocking)
    wait_for_saves()  # (raised once: nothing left to raise)
    assert not (tmp_path / "next.safetensors").exists()  # raised before anything was written


def test_the_handle_raises_once_and_then_is_done(tmp_path):
    model, opt = _trained()
    blocker = tmp_path / "f"
    blocker.write_text("x")
    handle = coatstate.save(opt, str(blocker / "y.safetensors"), blocking=False)
    with pytest.raises(RuntimeError):
        handle.wait()
    assert handle.done()
    handle.wait()


def _step(model, opt):
    device = next(model.parameters()).device
    model(torch.randn(8, 64, device=device)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
@pytest.mark.parametrize("distributed", ["gathered", "per_rank"])
def test_saves_snapshot_at_the_call_and_equal_blocking_ones(tmp_path, distributed, device):
    """Async saves snapshot at the call (training goes on while they write; from CUDA into pinned
    memory), blocking per-rank saves reuse the async saves' pinned buffers, and every file holds
    what a blocking single-file save of the same state holds, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32)).to(
        device
    )
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)
    for _ in range(3):
        _step(model, opt)
    urls = {n: str(tmp_path / f"{n}.safetensors") for n in ("ref0", "bg0", "ref1", "block1", "bg1")}
    coatstate.save(opt, urls["ref0"], model=model)  # gathered, blocking: the reference
    handle = coatstate.save(opt, urls["bg0"], model=model, blocking=False, distributed=distributed)
    _step(model, opt)  # changes the state while bg0 is written
    handle.wait()
    coatstate.save(opt, urls["ref1"], model=model)
    coatstate.save(opt, urls["block1"], model=model, distributed=distributed)  # the pinned buffers again
    handle = coatstate.save(opt, urls["bg1"], model=model, blocking=False, distributed=distributed)
    _step(model, opt)
    handle.wait()
    for got, want in (("bg0", "ref0"), ("block1", "ref1"), ("bg1", "ref1")):
        assert _same(_tensors(read(urls[got])), _tensors(read(urls[want]))), got
    assert not _same(_tensors(read(urls["ref0"])), _tensors(read(urls["ref1"])))  # (the steps did change it)


_EXIT_CHILD = """
import shutil, sys, torch, coatstate
from coatstate.checkpoint import container
url, mode, fail = sys.argv[1], sys.argv[2], sys.argv[3] == "fail"
torch.manual_seed(0)
m = torch.nn.Linear(64, 64) if fail else torch.nn.Linear(512, 512)
o = coatstate.CompressedAdamW(m.parameters())
m(torch.randn(2, m.in_features)).sum().backward()
o.step()
if fail:
    coatstate.save(o, url, model=m)  # the previous checkpoint, which must survive
    shutil.copy(url, url + ".before")

    def broken(f, tensors, metadata):
        f.write(b"partial")
        raise OSError("disk full (injected)")

    container.write_safetensors = broken
    with torch.no_grad():
        m.weight.add_(1.0)
coatstate.save(o, url, model=m, blocking=False, distributed=mode)
"""  # and the script ends at once, the save still running


def _run_and_exit(url: str, mode: str, fail: bool) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, url, mode, "fail" if fail else "ok"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("mode", ["gathered", "per_rank"])
def test_a_save_in_flight_when_the_script_ends_completes(tmp_path, mode):
    """Interpreter exit waits for the save before the thread pools its hashing uses shut down."""
    url = str(tmp_path / "ck.safetensors")
    done = _run_and_exit(url, mode, fail=False)
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr, done.stderr
    ckpt = read(url)  # (checksums verified)
    assert ckpt.model["weight"].shape == (512, 512)
    assert len(ckpt.optimizer["state"]) == 2


def test_a_save_that_fails_at_exit_fails_the_process_and_keeps_the_previous_file(tmp_path):
    url = str(tmp_path / "ck.safetensors")
    done = _run_and_exit(url, "gathered", fail=True)
    assert done.returncode == 1, done.stderr
    assert "background save to" in done.stderr and "disk full (injected)" in done.stderr, done.stderr
    with open(url, "rb") as now, open(url + ".before", "rb") as before:
        assert now.read() == before.read()  # the blocking save's file, intact
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors", "ck.safetensors.before"]  # (no temp files)
