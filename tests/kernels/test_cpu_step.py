"""The compiled CPU step (kernels/cpu_step.cpp) gives the pure-torch twin's bits, for every format.

Each test runs two CompressedAdamW on copies of the same parameters and gradients: fused=None
(the C++ step) and fused=False (the twin, coatstate.optim.reference_step), and compares the
parameters, the master corrections and every compressed moment bit for bit after several steps.
Gradients are random and non-zero, at scales from 1 to 1e-4, so groups see a wide range.
"""

from __future__ import annotations

import logging

import pytest
import torch
from coatstate.formats.optimizer_state import MASTER_CORRECTION, init_moment
from coatstate.kernels import cpu_step

import coatstate
from coatstate.optim.moments import moment_formats
from coatstate.optim.reference_step import adamw_step_cpu, adamw_step_reference

pytestmark = pytest.mark.skipif(cpu_step.compiler() is None, reason="no C++ compiler")

FP8 = [
    dict(),  # defaults: E4M3, expansion on both moments
    dict(exp_avg_expand=False, exp_avg_sq_expand=False),
    dict(exp_avg_format="e5m2", exp_avg_sq_format="e5m2"),
    dict(exp_avg_format="e5m2", exp_avg_sq_format="e4m3", exp_avg_expand=False),
    dict(exp_avg_format="e4m3", exp_avg_sq_format="e5m2", exp_avg_sq_expand=False),
]
FOUR_BIT = dict(exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt")
SHAPES = [(3, 129), (7, 1000), (2, 1), (1, 4097), (70, 257), (4, 3, 50)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point and t.element_size() in (1, 2, 4):
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(_bits(a), _bits(b)):
        differ = (_bits(a) != _bits(b)).sum().item()
        raise AssertionError(
            f"{what}: {differ} of {a.numel()} values differ between fused=None (the C++ step) and the twin"
        )


def _run_pair(
    shapes, dtype=torch.float32, steps=3, seed=0, scaler=None, closure_lr=None, grads_for=None, **options
):
    """Step both paths `steps` times on the same data; compare everything after each step.
    grads_for(step): the indices of the parameters that get a gradient (default: all). Returns
    (the fused=None optimizer, the twin, their parameters)."""
    gen = torch.Generator().manual_seed(seed)
    start = [(torch.randn(s, generator=gen) * 0.02).to(dtype) for s in shapes]
    fast = [torch.nn.Parameter(x.clone()) for x in start]
    twin = [torch.nn.Parameter(x.clone()) for x in start]
    options.setdefault("min_numel", 1)
    of = coatstate.CompressedAdamW(fast, **options)
    ot = coatstate.CompressedAdamW(twin, fused=False, **options)
    for step in range(steps):
        with_grad = grads_for(step) if grads_for else range(len(shapes))
        for i, (pf, pt) in enumerate(zip(fast, twin, strict=True)):
            g = (torch.randn(pf.shape, generator=gen) * 10.0 ** -(step % 5)).to(dtype)
            pf.grad, pt.grad = (g.clone(), g.clone()) if i in with_grad else (None, None)
        if scaler is not None:
            for o in (of, ot):
                o.grad_scale, o.found_inf = scaler
        if closure_lr is not None:
            for o in (of, ot):
                o.param_groups[0]["lr"].fill_(closure_lr(step))
        of.step()
        ot.step()
        for i, (pf, pt) in enumerate(zip(fast, twin, strict=True)):
            _assert_same(pf.detach(), pt.detach(), f"step {step}, param {i} {tuple(pf.shape)}")
            sf, st = of.state[pf], ot.state[pt]
            assert sf.keys() == st.keys()
            for key in sf:
                if key != "step":
                    _assert_same(sf[key], st[key], f"step {step}, param {i} {tuple(pf.shape)}, {key}")
    return of, ot, fast, twin


@pytest.mark.parametrize(
    "fmt", FP8 + [FOUR_BIT], ids=["defaults", "e4m3", "e5m2x", "mixed1", "mixed2", "4bit"]
)
def test_every_format_on_odd_shapes(fmt):
    _run_pair(SHAPES, **fmt)


@pytest.mark.parametrize("group_size", [2, 64, 100, 129 * 2])
@pytest.mark.parametrize("fmt", [FP8[0], FP8[1], FOUR_BIT], ids=["defaults", "e4m3", "4bit"])
def test_group_sizes(fmt, group_size):
    _run_pair([(5, 300), (2, 1001)], group_size=group_size, steps=3, **fmt)


@pytest.mark.parametrize("master_bits", [None, 16, 24, 32])
@pytest.mark.parametrize("fmt", [FP8[0], FP8[1], FOUR_BIT], ids=["defaults", "e4m3", "4bit"])
def test_bfloat16_params_and_masters(fmt, master_bits):
    _run_pair(SHAPES[:4], dtype=torch.bfloat16, master_bits=master_bits, **fmt)


@pytest.mark.parametrize("fmt", FP8[:3], ids=["defaults", "e4m3", "e5m2x"])
def test_amsgrad(fmt):
    _run_pair(SHAPES[:3], amsgrad=True, **fmt)


@pytest.mark.parametrize("fmt", [FP8[0], FOUR_BIT], ids=["defaults", "4bit"])
def test_maximize_weight_decay_and_betas(fmt):
    _run_pair(SHAPES[:3], maximize=True, weight_decay=0.3, betas=(0.5, 0.9), eps=1e-6, **fmt)
    _run_pair(SHAPES[:3], weight_decay=0.0, betas=(0.95, 0.95), **fmt)


def test_tensor_lr_from_a_schedule():
    _run_pair(SHAPES[:3], lr=torch.tensor(1e-3), closure_lr=lambda step: 1e-3 / (step + 1), steps=5)


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_grad_scaler(found_inf):
    _run_pair(SHAPES[:3], scaler=(torch.tensor(1024.0), torch.tensor(found_inf)))


def test_one_dimensional_and_bfloat16_gradients():
    _run_pair([(1001,), (64,)], compress_1d=True)
    _run_pair(
        [(7, 300)],
        dtype=torch.bfloat16,
        master_bits=24,
        exp_avg_format="e2m1",
        exp_avg_sq_format="ue3m1_sqrt",
    )


@pytest.mark.parametrize("fmt", [FP8[0], FOUR_BIT], ids=["defaults", "4bit"])
def test_gradient_release(fmt):
    def train(fused):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(33, 200), torch.nn.GELU(), torch.nn.Linear(200, 7))
        opt = coatstate.CompressedAdamW(
            model.parameters(), fused=fused, gradient_release=True, min_numel=1, **fmt
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randn(16, 33, generator=gen)).square().mean().backward()
            opt.step()
        return model, opt

    (mf, of), (mt, ot) = train(None), train(False)
    for (name, pf), pt in zip(mf.named_parameters(), mt.parameters(), strict=True):
        _assert_same(pf.detach(), pt.detach(), name)
        for key in of.state[pf]:
            if key != "step":
                _assert_same(of.state[pf][key], ot.state[pt][key], f"{name} {key}")


def test_a_shard_rounds_by_its_place_in_the_whole_tensor():
    """first_element keys the 4-bit second moment's and master 16's stochastic rounding."""
    opt = coatstate.CompressedAdamW([torch.nn.Parameter(torch.zeros(6, 40))], min_numel=1, **FOUR_BIT)
    formats = moment_formats(opt.param_groups[0], (6, 40))
    results = []
    for fn in (adamw_step_cpu, adamw_step_reference):
        p = (torch.randn(6, 40, generator=torch.Generator().manual_seed(4)) * 0.1).to(torch.bfloat16)
        g = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        state = {}
        for name in ("exp_avg", "exp_avg_sq"):
            init_moment(state, name, p, formats[name])
        state[MASTER_CORRECTION] = torch.zeros(6, 40, dtype=torch.int8)
        fn(p, g, state, formats, first_element=12345, lr=1e-2, beta1=0.9,
           beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False, amsgrad=False, step=1.0,
           master_bits=16, seed=7)  # fmt: skip
        results.append((p, state))
    (pf, sf), (pt, st) = results
    _assert_same(pf, pt, "param")
    for key in sf:
        _assert_same(sf[key], st[key], key)


def test_without_a_compiler_the_twin_steps_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_step, "compiler", lambda: None)
    cpu_step.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="coatstate"):
            of, *_ = _run_pair([(3, 129)], steps=2)
            _run_pair([(2, 300)], steps=2)
        lines = [r.getMessage() for r in caplog.records if "C++ compiler" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "apt install g++" in lines[0] and "CXX" in lines[0], lines[0]
        assert of.state  # the step ran (through the twin)
    finally:
        cpu_step.library.cache_clear()


def test_the_compiled_step_is_what_runs():
    assert cpu_step.library() is not None, "the C++ step did not build here"


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_equal_to_the_twin_under_other_cpu_capabilities(capability):
    """The twin's eager lerp/addcmul may round differently per ATen capability (FMA or not); the
    launcher's probe follows whichever this process uses."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    test = f"{__file__}::test_every_format_on_odd_shapes"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:]
