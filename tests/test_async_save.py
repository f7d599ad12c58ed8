"""coatstate.save(blocking=False): the file equals a blocking save's, the snapshot is taken at the
call (training may go on at once), and a failure is raised at the next save or wait, never lost."""

from __future__ import annotations

import pytest
import torch

import coatstate
from coatstate.checkpoint import SaveHandle, read, wait_for_saves


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
