"""NaN and Inf in gradients and moments: the policy of docs/FORMAT.md ("Non-finite values").

A non-finite value stays where it is, element by element, as in torch.optim.AdamW: the codec
stores it as the FP8 NaN code and leaves it out of its group's scale, so the group's finite
values are what they would be without it; a second moment reads the code back as +Inf (g*g
overflowed, or a NaN gradient already made exp_avg NaN), so a parameter is finite exactly where
torch's is. Every step that produces one is reported. Each test runs on the pure-torch step and
on the fused Triton step (the interpreter on CPU, compiled on a GPU).
"""

import pytest
import torch
from coatstate.formats.fp8 import FP8Format
from coatstate.formats.group import quantize_groups
from coatstate.formats.optimizer_state import read_moment
from coatstate.kernels import adamw_fused
from coatstate.kernels.runtime import interpreting

from coatstate import CompressedAdamW
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = (8, 256)  # two groups per row: small enough for the interpreter
BAD = (3, 5)


def _run(grads, fused, expand, opt_cls=CompressedAdamW, weight_decay=0.0):
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(SHAPE, device=DEVICE))
    if opt_cls is CompressedAdamW:
        opt = opt_cls([p], lr=1e-2, weight_decay=weight_decay, min_numel=1, fused=fused,
                      exp_avg_expand=expand, exp_avg_sq_expand=expand)  # fmt: skip
    else:
        opt = opt_cls([p], lr=1e-2, weight_decay=weight_decay)
    for g in grads:
        p.grad = g.clone().to(DEVICE)
        opt.step()
    return p.detach(), opt


def _grads(n, bad_value=None, at=BAD):
    gen = torch.Generator().manual_seed(2)
    out = [torch.randn(SHAPE, generator=gen) for _ in range(n)]
    if bad_value is not None:
        out[0][at] = bad_value
    return out


PATHS = pytest.mark.parametrize("fused", [False, True], ids=["twin", "fused"])
EXPAND = pytest.mark.parametrize("expand", [False, True], ids=["plain", "expand"])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@EXPAND
def test_codec_leaves_nonfinite_values_out_of_their_group(fmt, expand):
    x = torch.randn(4, 256) * 3
    clean = x.clone()
    clean[1, 7] = clean[2, 200] = clean[3, 0] = 0.0
    x[1, 7], x[2, 200], x[3, 0] = float("nan"), float("inf"), -float("inf")
    codes, scales, exps = quantize_groups(x, 128, FP8Format.parse(fmt), expand)
    want_codes, want_scales, want_exps = quantize_groups(clean, 128, FP8Format.parse(fmt), expand)
    bad = ~torch.isfinite(x)
    assert torch.isnan(codes.float()[bad]).all(), "a non-finite value must be stored as the NaN code"
    assert torch.equal(codes.view(torch.uint8)[~bad], want_codes.view(torch.uint8)[~bad])
    assert torch.equal(scales, want_scales)
    assert exps is None or torch.equal(exps, want_exps)


@PATHS
@EXPAND
def test_nan_gradient_keeps_the_rest_of_its_group(fused, expand):
    """From a zero state, a NaN gradient element and a zero one give the same moments and
    parameters everywhere but at that element (its value is out of its group's scale)."""
    p_nan, opt_nan = _run(_grads(1, float("nan")), fused, expand)
    p_zero, opt_zero = _run(_grads(1, 0.0), fused, expand)
    other = torch.ones(SHAPE, dtype=torch.bool, device=DEVICE)
    other[BAD] = False
    assert torch.isnan(p_nan[BAD]) and torch.equal(p_nan[other], p_zero[other])
    for name in ("exp_avg", "exp_avg_sq"):
        a = read_moment(opt_nan.state[opt_nan.param_groups[0]["params"][0]], name, 128)
        b = read_moment(opt_zero.state[opt_zero.param_groups[0]["params"][0]], name, 128)
        assert torch.equal(a[other], b[other]), f"{name}: the healthy values of the group changed"
        assert not torch.isfinite(a[BAD]), name


@PATHS
@EXPAND
@pytest.mark.parametrize("where", ["one", "all"])
def test_huge_finite_gradients_keep_parameters_finite_where_torch_does(fused, expand, where):
    """g = 1e38 overflows g*g: torch's exp_avg_sq is +Inf there, its update m / Inf is 0 from then
    on, and the parameter stays finite. Ours must agree on finiteness at every step and leave
    those elements exactly where torch leaves them."""
    grads = _grads(4)
    if where == "all":
        grads[0] = torch.full(SHAPE, 1e38)
    else:
        grads[0][BAD] = 1e38
    ours, opt = _run(grads, fused, expand, weight_decay=0.1)
    theirs, ref = _run(grads, fused, expand, opt_cls=torch.optim.AdamW, weight_decay=0.1)
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all()
    frozen = torch.isinf(ref.state[ref.param_groups[0]["params"][0]]["exp_avg_sq"])
    assert frozen.any()
    assert torch.equal(ours[frozen], theirs[frozen])
    v = read_moment(opt.state[opt.param_groups[0]["params"][0]], "exp_avg_sq", 128)
    assert torch.equal(torch.isinf(v), frozen)
    if where == "one":  # the rest of the tensor trains as without the outlier, within FP8 error
        assert (ours - theirs)[~frozen].abs().max() < 0.05


@PATHS
def test_every_step_with_a_nonfinite_moment_is_reported(fused):
    _, opt = _run(_grads(3, float("nan")), fused, expand=False)
    (report,) = opt.nonfinite_parameters()
    # the NaN stays in the moments (lerp keeps it), as in torch: one element at each of 3 steps
    assert (report["steps"], report["last_step"], report["count"]) == (3, 3, 3)
    assert opt.nonfinite_parameters() == []


@PATHS
def test_finite_moments_whose_sum_overflows_are_not_reported(fused):
    """g = 1.8e19: g*g stays finite, and after six steps a program's sum of m + v (the fused
    step's first test for a non-finite moment) overflows float32, at the GPU's launch (2 groups a
    program, one row here) as at the interpreter's (the whole tensor). The exact count behind that
    test finds nothing, so nothing is reported, and the parameter stays finite."""
    grads = [torch.full(SHAPE, 1.8e19) for _ in range(6)]
    p, opt = _run(grads, fused, expand=False)
    v = read_moment(opt.state[opt.param_groups[0]["params"][0]], "exp_avg_sq", 128)
    rows = adamw_fused.groups_per_program(interpreting()) * 128 // SHAPE[1]  # the first program's rows
    assert torch.isfinite(v).all() and float(v[:rows].sum(dtype=torch.float32)) == float("inf")
    assert torch.isfinite(p).all()
    assert opt.nonfinite_parameters() == []


@requires_cuda
@pytest.mark.gpu
@EXPAND
def test_fused_nonfinite_policy_on_large_tensors_gpu(expand):
    """The fused step on a large tensor with NaN and 1e38 gradients scattered over many groups:
    the same finiteness as the twin at every element, and the same report."""
    shape = (1024, 4096)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    flat = grads[0].view(-1)
    flat[torch.randint(0, flat.numel(), (500,), generator=gen)] = float("nan")
    flat[torch.randint(0, flat.numel(), (500,), generator=gen)] = 1e38
    out = {}
    for fused in (False, True):
        p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(4)).cuda())
        opt = CompressedAdamW([p], lr=1e-3, fused=fused, exp_avg_expand=expand, exp_avg_sq_expand=expand)
        for g in grads:
            p.grad = g.cuda()
            opt.step()
        (report,) = opt.nonfinite_parameters()
        out[fused] = (p.detach(), report)
    (p_twin, r_twin), (p_fused, r_fused) = out[False], out[True]
    assert torch.equal(torch.isfinite(p_twin), torch.isfinite(p_fused))
    assert (r_twin["count"], r_twin["steps"]) == (r_fused["count"], r_fused["steps"])
    finite = torch.isfinite(p_twin)
    assert (p_twin - p_fused)[finite].abs().max() < 1e-2
