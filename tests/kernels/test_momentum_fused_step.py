"""The fused momentum step (kernels/momentum_fused.py) against its twin (optim/momentum_step.py).

On CPU it runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA). Plain
FP8, 4-bit and uncompressed momenta are compared bit for bit: both sides round in float32 onto the
grid before an exact cast, and the kernel spells each of torch's single-rounding `add(alpha=)` and
`lerp` as an fma, which the interpreter computes exactly (NOTES.md). With range expansion,
log2/exp2 differ in the last float32 bit (numpy's vs torch's), so a code may move by one FP8 step:
those runs are compared within that step's effect on the update instead.
"""

from __future__ import annotations

import pytest
import torch

from coatstate import CompressedLion, CompressedMuon, CompressedSGD
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 129), (7, 300), (64, 256), (5,), (130, 7)]
MATRICES = [(3, 129), (64, 256), (130, 7)]

CASES = {
    "sgd": (CompressedSGD, SHAPES, dict(lr=0.05, momentum=0.9, weight_decay=0.01, dampening=0.1)),
    "sgd-nesterov-maximize": (
        CompressedSGD,
        SHAPES,
        dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    ),
    "lion": (CompressedLion, SHAPES, dict(lr=1e-3, weight_decay=0.3, betas=(0.9, 0.99))),
    "muon": (CompressedMuon, MATRICES, dict(lr=0.02)),
    "muon-plain-momentum": (CompressedMuon, MATRICES, dict(lr=0.02, nesterov=False, momentum=0.4)),
}
EXACT = {"e4m3": dict(expand=False), "e5m2": dict(expand=False), "e2m1": {}, "fp32": None}


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in shapes]


def _options(cls, fmt, expand):
    if fmt == "fp32":
        return dict(compress=False)
    prefix = "exp_avg" if cls is CompressedLion else "momentum"
    out = {f"{prefix}_format": fmt, "min_numel": 1}
    if cls is not CompressedMuon:
        out["compress_1d"] = True
    if expand is not None:
        out[f"{prefix}_expand"] = expand
    return out


def _pair(name, fmt, expand):
    cls, shapes, kw = CASES[name]
    a, b = _params(shapes), _params(shapes)
    options = _options(cls, fmt, expand)
    return a, b, cls(a, fused=False, **options, **kw), cls(b, fused=True, **options, **kw)


def _steps(params_and_opts, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [
            torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))
            for p in params_and_opts[0][0]
        ]
        for params, opt in params_and_opts:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.to(DEVICE)
            opt.step()


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("name", CASES)
def test_fused_step_equals_the_twin_bit_for_bit(name, fmt):
    """Plain FP8, 4-bit e2m1 and float32 momenta: parameters and states equal, every step."""
    a, b, twin, fused = _pair(name, fmt, EXACT[fmt].get("expand") if EXACT[fmt] else None)
    for i in range(4):
        _steps([(a, twin), (b, fused)], 1, seed=i)
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {i}, param {k}: max difference {(x - y).abs().max().item():.3e}"
            for key, t in twin.state[x].items():
                u = fused.state[y][key]
                assert torch.equal(
                    t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                    u.view(torch.uint8) if u.dtype.itemsize == 1 else u,
                ), f"step {i}: {key}"
    assert fused.nonfinite_parameters() == []


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("name", ["sgd", "lion", "muon"])
def test_fused_step_with_expansion_tracks_the_twin(name, fmt):
    """A code that moves by one FP8 step moves the momentum by at most 1/8 (e4m3) of its value."""
    a, b, twin, fused = _pair(name, fmt, True)
    _steps([(a, twin), (b, fused)], 3)
    moment = twin.MOMENTS[0]
    for x, y in zip(a, b, strict=True):
        codes_t = twin.state[x][moment + "_codes"].view(torch.uint8).int()
        codes_f = fused.state[y][moment + "_codes"].view(torch.uint8).int()
        assert (codes_t - codes_f).abs().max().item() <= 1
        assert (codes_t != codes_f).float().mean().item() < 0.05
        rel = ((x - y).norm() / x.norm()).item()
        assert rel < 1e-2, f"parameters differ by {rel:.2e} (relative)"


def test_fused_step_reports_nonfinite_gradients():
    a, b, twin, fused = _pair("sgd", "e4m3", False)
    for params, opt in ((a, twin), (b, fused)):
        for p in params:
            p.grad = torch.ones_like(p)
        params[0].grad[0, 0] = float("nan")
        opt.step()
    for opt in (twin, fused):
        bad = opt.nonfinite_parameters()
        assert [x["shape"] for x in bad] == [(3, 129)] and bad[0]["count"] >= 1


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sgd", "lion", "muon"])
def test_fused_step_on_the_gpu_equals_the_cpu_twin(name):
    """Compiled on the GPU, plain E4M3: the kernel against the CPU twin, within 1e-6 absolute
    (Muon: 1e-3; its bfloat16 matmuls differ between the GPU and the CPU)."""
    cls, shapes, kw = CASES[name]
    a, b = _params(shapes), _params(shapes)
    options = _options(cls, "e4m3", False)
    twin = cls([torch.nn.Parameter(p.detach().cpu()) for p in a], fused=False, **options, **kw)
    fused = cls(b, fused=True, **options, **kw)
    cpu = twin.param_groups[0]["params"]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for x, y in zip(cpu, b, strict=True):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.to(DEVICE)
        twin.step()
        fused.step()
    for x, y in zip(cpu, b, strict=True):
        assert torch.allclose(x, y.cpu(), rtol=0, atol=1e-6 if name != "muon" else 1e-3)
