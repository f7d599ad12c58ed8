"""Gradient release under FSDP2 (gloo, 2 ranks) and under torch.compile of the model.

FSDP2 writes each sharded gradient after its reduce-scatter and runs the parameter's
post-accumulate-grad hooks itself, so the release hook steps the local shard there. Checked: no
gradient outlives the backward, the states equal the ordinary step's bit for bit, and
`max_grad_norm`'s norm is the global one (its DTensor sum of squares reduces over the ranks).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from test_distributed import LR, _fsdp, _init, _snapshot, _spawn, _train

from coatstate import CompressedAdamW

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


def _batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 64, generator=gen), torch.randn(16, 128, generator=gen)


def _release_worker(rank, world_size, port):
    from coatstate.distributed import full_tensor

    mesh = _init(rank, world_size, port)
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
