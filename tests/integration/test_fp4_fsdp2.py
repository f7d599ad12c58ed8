"""4-bit moments under FSDP2 (DTensor states, CPU/gloo, 2 ranks): packed codes are cut by rows
like their parameter, the sharded run equals the one-process run bit for bit (the 4-bit codec
has no vectorised-tail caveat: no log2/exp2, a float64 sqrt), and a gathered checkpoint saved by
the sharded run loads into one process bit for bit. Helpers: tests/integration/test_fsdp2_ddp.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import coatstate
from coatstate import CompressedAdamW
from tests.integration.test_fsdp2_ddp import (
    LR,
    STEPS,
    UNEVEN,
    _bits,
    _check_equal,
    _fsdp,
    _init,
    _model,
    _snapshot,
    _spawn,
    _train,
)

FOUR_BIT = dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


def _four_bit_worker(rank, world_size, store, out_dir):
    import torch.distributed as dist

    mesh = _init(rank, world_size, store)
    model = _fsdp(mesh)
    opt = CompressedAdamW(model.named_parameters(), lr=LR, weight_decay=0.1, **FOUR_BIT)
    _train(model, opt, 0, STEPS)
    p = dict(model.named_parameters())[UNEVEN]
    codes = opt.state[p]["exp_avg_codes"]
    assert type(codes).__name__ == "DTensor" and tuple(codes.shape) == (131, 128)  # 256 columns: 128 bytes
    assert codes.to_local().shape[0] == (66, 65)[rank], "packed codes are cut by rows like the parameter"
    got = _snapshot(model, opt)
    coatstate.save(opt, os.path.join(out_dir, "four.safetensors"), model=model)
    if rank == 0:
        ref = _model()
        ref_opt = CompressedAdamW(ref.named_parameters(), lr=LR, weight_decay=0.1, **FOUR_BIT)
        _train(ref, ref_opt, 0, STEPS)
        want = {n: {"param": q.detach().clone(), **ref_opt.state[q]} for n, q in ref.named_parameters()}
        _check_equal(got, want, list(want), "FSDP2 vs one process, 4-bit moments")
        torch.save(want, os.path.join(out_dir, "want.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_with_4bit_moments_matches_one_process(tmp_path):
    _spawn(_four_bit_worker, 2, str(tmp_path))
    want = torch.load(tmp_path / "want.pt", weights_only=True)
    ref = _model()
    opt = CompressedAdamW(ref.named_parameters(), lr=LR, weight_decay=0.1, **FOUR_BIT)
    coatstate.load(opt, str(tmp_path / "four.safetensors"), model=ref)
    for n, q in ref.named_parameters():
        assert torch.equal(q, want[n]["param"]), n
        for key, value in opt.state[q].items():
            if key != "step":
                assert torch.equal(_bits(value), _bits(want[n][key])), f"{n}.{key}"
