"""The parameters that keep float32 moments step together through foreach ops
(coatstate.optim.foreach_step) with the bits each gets from the per-parameter twin.

Each test runs CompressedAdamW with fused=None (the foreach batch for float32 moments, the C++
step for compressed ones) and fused=False (the twin, one parameter at a time) on copies of the
same parameters and random, non-zero gradients, and compares parameters and moments bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from coatstate.optim import foreach_step
from tests.kernels.test_cpu_step import _run_pair

# 1-D tensors (norm weights, biases) of odd lengths, and 2-D ones under min_numel
SHAPES = [(1,), (7,), (129,), (1000,), (4097,), (3, 5), (16, 17)]


def _pair(shapes, **options):
    """tests/kernels/test_cpu_step.py's two optimizers (fused=None and the twin, compared bit for
    bit after every step), small 2-D tensors keeping float32 moments unless asked otherwise."""
    options.setdefault("min_numel", 4096)
    return _run_pair(shapes, **options)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(weight_decay=0.0),
        dict(weight_decay=0.3, maximize=True, betas=(0.5, 0.9), eps=1e-6),
        dict(lr=3e-2, betas=(0.95, 0.95)),
    ],
    ids=["defaults", "no-decay", "maximize-betas-eps", "large-lr"],
)
def test_float32_moments_batched_match_the_twin(options):
    _pair(SHAPES, **options)


def test_beside_compressed_parameters():
    """A group that mixes compressed parameters (the C++ step) and float32-moment ones."""
    _pair([(64, 128), *SHAPES, (129, 33)], min_numel=1000)


def test_parameters_at_different_steps_step_with_their_own_bias_correction():
    """A parameter without a gradient skips a step: the batch is split by step count."""
    ob, _, batched, _ = _pair(SHAPES, steps=4, grads_for=lambda step: range(0, len(SHAPES), 2 - step % 2))
    assert sorted({ob.state[p]["step"].item() for p in batched}) == [2.0, 4.0]


def test_the_float32_moment_parameters_take_one_batch(monkeypatch):
    from coatstate.optim import adamw

    calls = []

    def spy(params, *args, **kwargs):
        calls.append(len(params))
        return foreach_step.adamw_step_foreach(params, *args, **kwargs)

    monkeypatch.setattr(adamw, "adamw_step_foreach", spy)
    _pair([(64, 128), *SHAPES], steps=2, min_numel=1000)
    assert calls == [len(SHAPES)] * 2


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_grad_scaler(found_inf):
    _pair(SHAPES, scaler=(torch.tensor(1024.0), torch.tensor(found_inf)))


def test_nonfinite_moments_are_counted_as_one_parameter_at_a_time_counts_them():
    ob, os_, batched, single = _pair(SHAPES, steps=1)
    for params, opt in ((batched, ob), (single, os_)):
        params[2].grad = torch.full_like(params[2], math.nan)
        params[4].grad = torch.randn_like(params[4])
        params[4].grad[::3] = math.inf
        opt.step()

    def counts(opt, params):
        index = {id(p): i for i, p in enumerate(params)}
        return {
            index[id(r["param"])]: (r["count"], r["steps"], r["last_step"])
            for r in opt.nonfinite_parameters()
        }

    found = counts(ob, batched)
    assert found == counts(os_, single) and sorted(found) == [2, 4], found


def test_what_is_batched():
    p, g = torch.zeros(5), torch.zeros(5)
    fp32 = {"exp_avg": None, "exp_avg_sq": None}
    assert foreach_step.batchable(p, g, fp32, lr=1e-3, amsgrad=False, master_bits=None)
    assert not foreach_step.batchable(p, g, fp32, lr=torch.tensor(1e-3), amsgrad=False, master_bits=None)
    assert not foreach_step.batchable(p, g, fp32, lr=1e-3, amsgrad=True, master_bits=None)
    bf16 = p.to(torch.bfloat16)
    assert not foreach_step.batchable(bf16, bf16, fp32, lr=1e-3, amsgrad=False, master_bits=None)
