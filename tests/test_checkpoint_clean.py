"""Per-rank checkpoints: what cleanup after a commit leaves alone."""

from __future__ import annotations

import os

import torch

from coatstate import checkpoint as ck
from coatstate.checkpoint import shards
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
