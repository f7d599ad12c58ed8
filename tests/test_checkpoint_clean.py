"""Per-rank checkpoints: what cleanup after a commit leaves alone; argument checks."""

from __future__ import annotations

import os

import pytest
import torch

from coatstate import checkpoint as ck
from coatstate.checkpoint import shards
from coatstate.cli.main import main
from coatstate.optim import CompressedAdamW


def _trained(seed: int = 0) -> tuple[torch.nn.Module, CompressedAdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 32)
    opt = CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1)  # FP8 moments for both
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    return model, opt


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
