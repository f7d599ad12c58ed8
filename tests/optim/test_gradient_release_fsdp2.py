"""Gradient release and master weights under FSDP2 (gloo, 2 ranks); release under torch.compile.

FSDP2 writes each sharded gradient after its reduce-scatter and runs the parameter's
post-accumulate-grad hooks itself, so the release hook steps the local shard there. Checked: no
gradient outlives the backward, the states equal the ordinary step's bit for bit, and
`max_grad_norm`'s norm is the global one (its DTensor sum of squares reduces over the ranks).
bfloat16 shards with the default 24-bit master step their local rows: bit for bit what one
process computes, with and without release.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import coatstate
from coatstate import CompressedAdamW
from tests.integration.test_fsdp2_ddp import LR, _fsdp, _init, _snapshot, _spawn, _train

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


def _batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 64, generator=gen), torch.randn(16, 128, generator=gen)


def _release_worker(rank, world_size, store):
    from coatstate.distributed import full_tensor

    mesh = _init(rank, world_size, store)
    runs = {}
    for release in (False, True):
        model = _fsdp(mesh)
        opt = CompressedAdamW(model.named_parameters(), lr=LR, weight_decay=0.1, gradient_release=release)
        _train(model, opt, 0, 3)
        x, y = _batch(3)
        torch.nn.functional.mse_loss(model(x), y).backward()
        alive = sum(p.grad is not None for p in model.parameters())
        assert alive == (0 if release else len(list(model.parameters()))), f"release={release}: {alive} grads"
        opt.step()
        opt.zero_grad()
        runs[release] = _snapshot(model, opt)
    for name, want in runs[False].items():
        for key, w in want.items():
            g = runs[True][name][key]
            assert torch.equal(
                g.view(torch.uint8) if g.element_size() == 1 else g,
                w.view(torch.uint8) if w.element_size() == 1 else w,
            ), (name, key)

    # max_grad_norm clips by the previous iteration's global gradient norm
    model = _fsdp(mesh)
    opt = CompressedAdamW(model.named_parameters(), lr=LR, gradient_release=True, max_grad_norm=1e9)
    ref = _fsdp(mesh)
    ref_opt = CompressedAdamW(ref.named_parameters(), lr=LR)
    x, y = _batch(0)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    ref_opt.step()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    got = full_tensor(opt._release.previous_norm)
    torch.testing.assert_close(got, full_tensor(want), rtol=1e-5, atol=0)
    dist.destroy_process_group()


def _bf16_fsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    from tests.integration.test_fsdp2_ddp import _model

    model = coatstate.cast_model(_model())  # bfloat16 Linears, the LayerNorm in float32
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train_bf16(model, opt, steps):
    for step in range(steps):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _master_worker(rank, world_size, store):
    """bfloat16 FSDP2 shards with the default 24-bit master, with and without release, against
    one process (rank 0) for every parameter whose rows split evenly."""
    from tests.integration.test_fsdp2_ddp import UNEVEN, _model

    mesh = _init(rank, world_size, store)
    runs = {}
    for release in (False, True):
        model = _bf16_fsdp(mesh)
        opt = CompressedAdamW(model.named_parameters(), lr=LR, weight_decay=0.1, gradient_release=release)
        assert opt.param_groups[0]["master_bits"] == 24
        _train_bf16(model, opt, 4)
        runs[release] = _snapshot(model, opt)
    assert runs[False].keys() == runs[True].keys()
    for name, want in runs[False].items():
        for key, w in want.items():
            assert torch.equal(_raw(runs[True][name][key]), _raw(w)), (name, key)
    if rank == 0:
        ref = coatstate.cast_model(_model())
        ref_opt = CompressedAdamW(ref.named_parameters(), lr=LR, weight_decay=0.1)
        _train_bf16(ref, ref_opt, 4)
        for name, q in ref.named_parameters():
            if name == UNEVEN:
                continue
            got = runs[False][name]
            assert torch.equal(_raw(got["param"]), _raw(q.detach())), name
            for key, value in ref_opt.state[q].items():
                assert torch.equal(_raw(got[key]), _raw(value)), (name, key)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_master_weights_under_fsdp2_match_one_process():
    _spawn(_master_worker, 2)


@pytest.mark.slow
def test_gradient_release_under_fsdp2_equals_the_ordinary_step():
    _spawn(_release_worker, 2)


def test_gradient_release_with_a_compiled_model():
    """The compiled backward still ends in autograd's AccumulateGrad, which runs the hooks."""
    runs = []
    for release in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
        opt = CompressedAdamW(model.parameters(), lr=LR, min_numel=1, gradient_release=release)
        compiled = torch.compile(model, backend="aot_eager")
        for step in range(3):
            x, y = _batch(step)
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            if release:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
