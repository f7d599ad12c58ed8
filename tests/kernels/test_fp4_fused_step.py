"""The fused step with 4-bit moments (kernels/fp4_triton.py) against the twin.

Under Triton's interpreter (no CUDA) the 4-bit codec is compared bit for bit: packed codes and
scales of every moment must be equal. Both sides then do the same float32 operations in the same
order: one correctly rounded division a group, exact midpoint comparisons, a correctly rounded
sqrt. The moment updates are made exact on both sides by the betas (0.5, 0.0): m = g - (g - m)/2
and v = g*g round once whatever the hardware fuses, while torch's CPU addcmul may fuse
v*b2 + (1-b2)*g*g into one fma where the kernel rounds twice, a 1-ulp difference that is the
update's, not the codec's. The decode path is still exercised bit for bit: m's decoded state
feeds m, and with amsgrad the decoded max_exp_avg_sq feeds the maximum. Weights are compared
within a few float32 ulps (the twin's denominator uses torch's CPU sqrt, which can be 1 ulp off;
the FP8 fused step shows the same), bfloat16 ones within one bfloat16 step.
On a GPU see tests/kernels/test_fp4_fused_step_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from coatstate.formats.fp4 import CODEBOOKS, decode_levels, unpack
from coatstate.formats.fp4 import _nearest as _twin_nearest
from coatstate.kernels.fp4_triton import E2M1, UE3M1_SQRT, _level, _nearest

from coatstate import CompressedAdamW

# the interpreter's exactness (fast_divide divides exactly there); on CUDA:
# tests/kernels/test_fp4_fused_step_gpu.py
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test: CUDA runs test_fp4_fused_step_gpu.py"
)

SHAPES = [(3, 129), (1, 300), (5, 127), (7, 2, 33), (4, 256), (2, 1), (300,)]
EVEN_SHAPES = [(4, 256), (2, 128), (3, 384), (128,), (5, 3, 128)]
"""every row whole groups of 128: the launch's EVEN specialization (int32 words of packed codes)"""
BETAS = (0.5, 0.0)
FORMATS = [("e2m1", "ue3m1_sqrt"), ("e4m3", "ue3m1_sqrt"), ("e2m1", "e4m3")]


def _params(dtype, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in shapes]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(p.shape, generator=g).mul(torch.rand((), generator=g) + 0.01).to(p.dtype) for p in params
    ]


def _pair(dtype, fm, fv, shapes=SHAPES, **kw):
    a, b = _params(dtype, shapes=shapes), _params(dtype, shapes=shapes)
    # an FP8 moment without expansion: its codec is bit-exact too (expansion's log2/exp2 are
    # not, tests/kernels/test_triton_kernels.py)
    fp8 = {f"{n}_expand": False for n, f in (("exp_avg", fm), ("exp_avg_sq", fv)) if f in ("e4m3", "e5m2")}
    opts = dict(lr=1e-2, betas=BETAS, min_numel=1, compress_1d=True, exp_avg_format=fm, exp_avg_sq_format=fv)
    opts.update(fp8, **kw)
    return a, b, CompressedAdamW(a, fused=False, **opts), CompressedAdamW(b, fused=True, **opts)


def _bits(t):
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int32)
        if t.dtype == torch.float32
        else t
    )


def _assert_same(a, b, opt_a, opt_b, step, before, carried):
    for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
        where = f"step {step}, param {i} {tuple(pa.shape)}"
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys(), where
        for k in sa:
            if k.endswith(("_codes", "_scales")):
                assert torch.equal(_bits(sa[k]), _bits(sb[k])), f"{where}: {k} differs"
        diff = (pa.float() - pb.float()).abs()
        # the difference carried from earlier steps plus a few ulps of the weight and of this
        # step's update (|m / denom| can be far above 1 here: the gradients change scale)
        update = (pa.float() - before[i]).abs()
        ulps = 2**-7 if pa.dtype == torch.bfloat16 else 2**-21
        tol = carried[i] + (pa.float().abs() + update) * ulps + 1e-12
        assert (diff <= tol).all(), f"{where}: weights differ by up to {diff.max():.3e}"
        carried[i] = diff.detach()


def _run(a, b, opt_a, opt_b, steps=3, **step_kw):
    carried = [torch.zeros(p.shape) for p in a]
    for step in range(steps):
        before = [p.detach().float().clone() for p in a]
        for params, opt in ((a, opt_a), (b, opt_b)):
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = g
            opt.step(**step_kw)
        _assert_same(a, b, opt_a, opt_b, step, before, carried)


@pytest.mark.parametrize(("fm", "fv"), FORMATS, ids="/".join)
@pytest.mark.parametrize(
    ("dtype", "master_bits"),
    [(torch.float32, None), (torch.bfloat16, 24), (torch.bfloat16, 32), (torch.bfloat16, 16)],
    ids=["fp32", "bf16-24", "bf16-32", "bf16-16"],
)
def test_fused_4bit_step_equals_the_twin_bit_for_bit(fm, fv, dtype, master_bits):
    a, b, opt_a, opt_b = _pair(dtype, fm, fv, master_bits=master_bits)
    _run(a, b, opt_a, opt_b)
    state = opt_b.state[b[0]]
    if fm == "e2m1":
        assert state["exp_avg_codes"].shape == (3, 65) and state["exp_avg_codes"].dtype == torch.uint8


@pytest.mark.parametrize(("fm", "fv"), FORMATS, ids="/".join)
@pytest.mark.parametrize(
    ("dtype", "master_bits"), [(torch.float32, None), (torch.bfloat16, 24)], ids=["fp32", "bf16-24"]
)
def test_fused_4bit_step_on_whole_groups_equals_the_twin_bit_for_bit(fm, fv, dtype, master_bits):
    a, b, opt_a, opt_b = _pair(dtype, fm, fv, EVEN_SHAPES, master_bits=master_bits)
    _run(a, b, opt_a, opt_b)
    launches = [x for prepared in opt_b._prepared.values() for x in prepared.launches]
    assert launches and all(x.plan.even for x in launches)


@pytest.mark.parametrize(("fm", "fv"), [*FORMATS, ("e4m3", "e4m3")], ids="/".join)
@pytest.mark.parametrize("shapes", [SHAPES, EVEN_SHAPES], ids=["any", "whole-groups"])
def test_fused_step_at_the_default_launch_equals_the_twin(fm, fv, shapes, monkeypatch):
    """The interpreter launches programs of INTERPRETER_GROUPS_PER_PROGRAM groups (it pays per
    program); the GPU's smaller default programs, with tensors ending mid-program, give the same bits."""
    from coatstate.kernels import adamw_fused

    monkeypatch.setattr(adamw_fused, "INTERPRETER_GROUPS_PER_PROGRAM", None)
    a, b, opt_a, opt_b = _pair(torch.bfloat16, fm, fv, shapes, master_bits=24)
    _run(a, b, opt_a, opt_b)
    launches = [x for prepared in opt_b._prepared.values() for x in prepared.launches]
    assert launches and all(x.plan.gpp == adamw_fused.GROUPS_PER_PROGRAM for x in launches)


@pytest.mark.parametrize(
    "shapes, first",
    [(SHAPES, 4099), (EVEN_SHAPES, 4099), (EVEN_SHAPES, 2**32 - 64)],
    ids=["bytes", "words-odd-place", "words-across-2**32"],
)
def test_fused_4bit_v_rounds_by_global_element_as_the_twin(shapes, first, monkeypatch):
    """The second moment's stochastic rounding is keyed by each element's offset in the global
    tensor: with every local tensor placed at element `first` of its global one (a dim-0 shard's
    place), the kernel (that offset in its meta) still equals the twin bit for bit, and the codes
    differ from those of a tensor placed at 0. An odd place splits the hash's pairs of
    neighbours, so whole-group rows take the per-element path; an even one just below 2**32
    keeps the pair path and wraps its pair index as the twin's offsets mod 2**32 do."""
    from coatstate.optim import adamw as adamw_module

    a, b, opt_a, opt_b = _pair(torch.float32, "e4m3", "ue3m1_sqrt", shapes)
    monkeypatch.setattr(adamw_module, "first_element", lambda p: first)
    _run(a, b, opt_a, opt_b)
    launches = [x for prepared in opt_b._prepared.values() for x in prepared.launches]
    want_even = shapes is EVEN_SHAPES and first % 2 == 0
    assert launches and all(x.plan.launch_even(x.fm, x.fv) == want_even for x in launches)
    monkeypatch.setattr(adamw_module, "first_element", lambda p: 0)
    c, d, opt_c, opt_d = _pair(torch.float32, "e4m3", "ue3m1_sqrt", shapes)
    _run(c, d, opt_c, opt_d)
    big = [i for i, p in enumerate(a) if p.numel() >= 256]
    assert any(
        not torch.equal(opt_a.state[a[i]]["exp_avg_sq_codes"], opt_c.state[c[i]]["exp_avg_sq_codes"])
        for i in big
    )


def test_fused_4bit_whole_groups_nan_and_inf_equal_the_twin():
    """The EVEN specialization's rare path: a program holding a NaN or an Inf (NaN scales, codes
    from the finite values), and v's decoded NaN scales read as +Inf. (Not with amsgrad: there the
    kernel's maximum drops a NaN that the twin's torch.maximum keeps, in the FP8 step too.)"""
    a, b, opt_a, opt_b = _pair(torch.float32, "e2m1", "ue3m1_sqrt", EVEN_SHAPES)
    _run(a, b, opt_a, opt_b, steps=2)
    for params, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(params, _grads(params, 5), strict=True):
            p.grad = g
        params[0].grad[1, 5] = float("nan")
        params[2].grad[2, 300] = float("inf")
        params[2].grad[0, 7] = -float("inf")
        opt.step()
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa.isnan(), pb.isnan())
    for pa, pb in zip(a, b, strict=True):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        for k in sa:
            if k.endswith(("_codes", "_scales")):
                assert torch.equal(_bits(sa[k]), _bits(sb[k])), k
    assert torch.isnan(opt_b.state[b[0]]["exp_avg_scales"][1, 0])
    assert torch.isnan(opt_b.state[b[2]]["exp_avg_sq_scales"][2, 2])
    assert sorted(x["shape"] for x in opt_b.nonfinite_parameters()) == [(3, 384), (4, 256)]


def test_fused_4bit_whole_groups_amsgrad_and_maximize_equal_the_twin():
    a, b, opt_a, opt_b = _pair(torch.float32, "e2m1", "ue3m1_sqrt", EVEN_SHAPES, amsgrad=True, maximize=True)
    _run(a, b, opt_a, opt_b)


def test_fused_4bit_amsgrad_and_maximize_equal_the_twin():
    a, b, opt_a, opt_b = _pair(torch.float32, "e2m1", "ue3m1_sqrt", amsgrad=True, maximize=True)
    _run(a, b, opt_a, opt_b)
    assert opt_b.state[b[0]]["max_exp_avg_sq_codes"].dtype == torch.uint8


def test_fused_4bit_skips_the_step_on_found_inf():
    a, b, opt_a, opt_b = _pair(torch.float32, "e2m1", "ue3m1_sqrt")
    _run(a, b, opt_a, opt_b, steps=1)
    before = [p.detach().clone() for p in b]
    found = torch.ones(())
    for p, g in zip(b, _grads(b, 9), strict=True):
        p.grad = g
    opt_b.grad_scale, opt_b.found_inf = torch.ones(()), found  # as torch.amp.GradScaler.step sets them
    opt_b.step()
    assert all(torch.equal(x, p) for x, p in zip(before, b, strict=True))
    assert opt_b.state[b[0]]["step"].item() == 1


def test_fused_4bit_nan_gradient_is_counted_and_matches_the_twin():
    a, b, opt_a, opt_b = _pair(torch.float32, "e2m1", "ue3m1_sqrt")
    for params, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(params, _grads(params, 0), strict=True):
            p.grad = g
        params[0].grad[1, 5] = float("nan")
        opt.step()
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa.isnan(), pb.isnan())
    for k in ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"):
        assert torch.equal(_bits(opt_a.state[a[0]][k]), _bits(opt_b.state[b[0]][k])), k
    assert torch.isnan(opt_b.state[b[0]]["exp_avg_scales"][1, 0])
    assert b[0][1, 5].isnan() and not b[0][1, 6].isnan(), "v's NaN group reads as +Inf: m / Inf = 0"
    assert [x["shape"] for x in opt_b.nonfinite_parameters()] == [(3, 129)]


@pytest.mark.parametrize("fused", [False, True], ids=["twin", "fused"])
def test_gradient_release_with_4bit_moments_equals_the_ordinary_step(fused):
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))  # noqa: E731
    a = make().to(torch.bfloat16)
    b = make().to(torch.bfloat16)
    b.load_state_dict(a.state_dict())
    kw = dict(
        lr=1e-2,
        min_numel=1,
        master_bits=24,
        fused=fused,
        exp_avg_format="e2m1",
        exp_avg_sq_format="ue3m1_sqrt",
    )
    opt_a = CompressedAdamW(a.parameters(), **kw)
    opt_b = CompressedAdamW(b.parameters(), gradient_release=True, **kw)
    for _ in range(3):
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(p.grad is None for p in b.parameters()), "released gradients must be freed"
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert opt_b.state[b[0].weight]["exp_avg_codes"].shape == (64, 16)


@triton.jit
def _levels_kernel(w_ptr, out_ptr, FMT: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs * 8 + N, _level(tl.load(w_ptr + offs), N, FMT))


@triton.jit
def _nearest_kernel(y_ptr, out_ptr, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _nearest(tl.load(y_ptr + offs), FMT))


@pytest.mark.parametrize(("codebook", "fmt"), [("e2m1", E2M1), ("ue3m1", UE3M1_SQRT)])
def test_kernel_decodes_every_code_at_every_nibble_of_a_word(codebook, fmt):
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (256,), generator=g, dtype=torch.int64).to(torch.int32)
    words[:16] = torch.arange(16, dtype=torch.int32) * 0x11111111  # each code in every nibble
    out = torch.empty((256, 8), dtype=torch.float32)
    for n in range(8):
        _levels_kernel[(1,)](words, out, fmt, n)
    codes = unpack(words.view(torch.uint8).view(256, 4), 8)  # byte j, low nibble first
    assert torch.equal(_bits(out), _bits(decode_levels(codes, codebook)))


@pytest.mark.parametrize(("codebook", "fmt"), [("e2m1", E2M1), ("ue3m1", UE3M1_SQRT)])
def test_kernel_nearest_code_at_every_level_and_midpoint_and_their_neighbours(codebook, fmt):
    """A sample of tests/formats/exhaustive_fp4_nearest.py (every float32 in [0, top], run by hand)."""
    levels = torch.tensor(CODEBOOKS[codebook][0], dtype=torch.float32)
    points = torch.cat([levels, (levels[1:] + levels[:-1]) / 2, torch.tensor([0.0, 2.0**-149, 1e-30])])
    bits = points.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)
    noise = torch.rand(2**14, generator=torch.Generator().manual_seed(0)) * 7
    y = torch.cat([bits.view(torch.float32).flatten(), noise])
    y = y[(y >= 0) & (y <= levels[-1] * (1 + 2**-22))]
    y = torch.nn.functional.pad(y, (0, -y.numel() % 1024))
    out = torch.empty(y.shape, dtype=torch.int32)
    _nearest_kernel[(y.numel() // 1024,)](y, out, fmt, 1024)
    assert torch.equal(out.long(), _twin_nearest(y.clamp(max=levels[-1].item()), levels))
