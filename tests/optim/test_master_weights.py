"""Compact master weights (master_bits 32/24/16) and gradient release.

The codec is tested on its own (exact round trip, the 24-bit bound, unbiased stochastic
rounding), then through the optimizer: master_bits=32 must train a bfloat16 model bit for bit as
float32 parameters do, the fused step (Triton's interpreter on CPU, compiled on a GPU) must give
the twin's masters, and gradient release must equal the ordinary step where both apply.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import triton
import triton.language as tl
from coatstate.formats import master_weights as mw
from coatstate.formats.optimizer_state import MASTER_CORRECTION
from coatstate.kernels.adamw_fused import _to_bf16

import coatstate
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _values(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.38e38, -3.38e38, math.inf, -math.inf, 1.0, -1.5])
    return torch.cat([x, specials])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


# ---------------------------------------------------------------------------------- the codec
def test_32_bit_split_is_exact_and_the_weight_is_the_nearest_bfloat16():
    x = _values(200_000, 0)
    w, rem = mw.split32(x)
    assert w.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert _same_bits(mw.join32(w, rem), x)
    finite = torch.isfinite(x) & (x.abs() < 3e38)
    err = (w.float() - x).abs()[finite]
    nearest = (x.to(torch.bfloat16).float() - x).abs()[finite]  # torch's round to nearest even
    assert (err <= nearest).all(), "the weight must be a nearest bfloat16 (it differs only at ties)"


def test_32_bit_split_keeps_nans():
    x = torch.tensor([math.nan, -math.nan]).float()
    w, rem = mw.split32(x)
    assert torch.isnan(w.float()).all() and torch.isnan(mw.join32(w, rem)).all()


def test_24_bit_error_is_within_its_bound():
    """|join24 - x| <= s = ulp(w) / 256: half of s from rounding the correction, the other half
    only where x lies within s / 2 of half a bfloat16 step above w (+128 is clamped to 127):
    1 value in 512 of a uniform spread, so at least 99.7% lie within s / 2."""
    x = _values(200_000, 1)
    x = x[torch.isfinite(x) & (x.abs() < 3e38)]
    w, c = mw.split24(x)
    s = mw.correction_scale(w)
    err = (mw.join24(w, c) - x).abs()
    ratio = (err / s).max().item()
    assert ratio <= 1.0, f"24-bit master error {ratio:.3f} s exceeds its bound s"
    assert ((err / s) <= 0.5).float().mean().item() > 0.997, "almost every element within s / 2"
    assert (w == x.to(torch.bfloat16)).all(), "the weight is the nearest bfloat16 (ties to even)"


def test_stochastic_rounding_is_unbiased_and_seeded():
    """Mean error over 10**6 roundings of one value: the rounding error is +-1 ulp-fractions with
    std ulp * sqrt(p (1 - p)), so the mean's std is that / 1000; the bound is 5 of those."""
    n = 10**6
    for value in (1.0 + 2**-10, -3.0 - 5 * 2**-9, 1e-3 * (1 + 1 / 3)):
        x = torch.full((n,), value)
        r = mw.stochastic_round_bf16(x, seed=7, step=3).float()
        v = float(x[0])  # (the float32 value actually rounded)
        ulp = 2.0 ** (math.floor(math.log2(abs(v))) - 7)  # bfloat16 keeps 7 fraction bits
        p = abs(v) / ulp - math.floor(abs(v) / ulp)  # the chance of rounding the magnitude up
        bound = 5 * ulp * math.sqrt(max(p * (1 - p), 1e-6)) / math.sqrt(n)
        bias = abs(r.double().mean().item() - v)
        assert bias <= bound, f"stochastic rounding of {value}: mean error {bias:.3e} > {bound:.3e}"
    a = mw.stochastic_round_bf16(torch.full((4096,), 1.0 + 2**-9), seed=1, step=1)
    b = mw.stochastic_round_bf16(torch.full((4096,), 1.0 + 2**-9), seed=2, step=1)
    c = mw.stochastic_round_bf16(torch.full((4096,), 1.0 + 2**-9), seed=1, step=2)
    assert not torch.equal(a, b) and not torch.equal(a, c), "seeds and steps must change the rounding"
    assert torch.equal(a, mw.stochastic_round_bf16(torch.full((4096,), 1.0 + 2**-9), seed=1, step=1))


# -------------------------------------------------------------------------------- the optimizer
def _shapes():
    return [(64, 96), (160,), (48, 160), (48,)]


def _grads(shapes, steps, seed=0):
    """bfloat16-representable gradients, so a bf16 and a float32 model see the same values."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=gen) * 1e-2).to(torch.bfloat16) for s in shapes] for _ in range(steps)]


def _params(shapes, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(s, generator=gen).to(torch.bfloat16).float() for s in shapes]  # bf16-exact start
    return [torch.nn.Parameter(t.to(dtype).to(device)) for t in x]


def _groups(params, **extra):
    return [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "lr": 3e-3, "amsgrad": True, **extra},
    ]


@pytest.mark.parametrize("fused", [False, True], ids=["twin", "fused"])
def test_master32_trains_bit_for_bit_as_float32_parameters(fused):
    # (the fused step runs under Triton's interpreter without CUDA: fewer steps there)
    shapes, steps = _shapes(), 50 if not fused or DEVICE == "cuda" else 8
    ref = _params(shapes, torch.float32, device=DEVICE)
    half = _params(shapes, torch.bfloat16, device=DEVICE)
    kw = dict(lr=1e-2, min_numel=1, compress_1d=True, fused=fused)
    opt_ref = coatstate.CompressedAdamW(_groups(ref), **kw)
    opt_half = coatstate.CompressedAdamW(_groups(half), master_bits=32, **kw)
    for i, grads in enumerate(_grads(shapes, steps)):
        scale = torch.tensor(1024.0, device=DEVICE)
        skip = torch.tensor(float(i % 17 == 5), device=DEVICE)  # a GradScaler that skips sometimes
        for params, opt, dtype in ((ref, opt_ref, torch.float32), (half, opt_half, torch.bfloat16)):
            for p, g in zip(params, grads, strict=True):
                p.grad = (g.float() * 1024).to(dtype).to(DEVICE)
            opt.grad_scale, opt.found_inf = scale, skip
            opt.step()
    for k, (r, h) in enumerate(zip(ref, half, strict=True)):
        master = mw.join32(h.detach().cpu(), opt_half.state[h][MASTER_CORRECTION].cpu())
        assert _same_bits(master, r.detach().cpu()), f"param {k}: the master differs from float32 training"
        assert torch.equal(h.detach().cpu(), mw.split32(r.detach().cpu())[0]), f"param {k}: weight"
    assert opt_half.state[half[0]]["step"].item() == steps - sum(i % 17 == 5 for i in range(steps))


def _one_step(master_bits, fused, seed=0):
    shapes = _shapes()
    half = _params(shapes, torch.bfloat16, seed=seed, device=DEVICE)
    opt = coatstate.CompressedAdamW(
        _groups(half), lr=1e-2, min_numel=1, compress_1d=True, fused=fused, master_bits=master_bits
    )
    for grads in _grads(shapes, 3, seed=seed):
        for p, g in zip(half, grads, strict=True):
            p.grad = g.to(DEVICE)
        opt.step()
    return half, opt


def test_master24_step_is_within_its_bound_of_the_float32_step():
    """One step from the same state: the 24-bit master lands within s of the float32 update of
    the master it started from (the bound of formats.master_weights)."""
    half, opt = _one_step(24, fused=False)
    for p in half:
        start = mw.join24(p.detach().clone(), opt.state[p][MASTER_CORRECTION].clone()).to(DEVICE)
        ref = torch.nn.Parameter(start.clone())
        opt_ref = coatstate.CompressedAdamW([ref], lr=1e-2, min_numel=1, compress_1d=True, fused=False)
        opt_ref.load_state_dict(
            {
                "state": {0: {k: v.clone() for k, v in opt.state[p].items() if k != MASTER_CORRECTION}},
                "param_groups": [{**opt.param_groups[0], "params": [0], "master_bits": None}],
            }
        )
        g = (torch.randn(p.shape) * 1e-2).to(torch.bfloat16).to(DEVICE)
        p.grad, ref.grad = g, g.float()
        group = next(gr for gr in opt.param_groups if any(q is p for q in gr["params"]))
        opt_ref.param_groups[0].update({k: group[k] for k in ("lr", "weight_decay", "amsgrad")})
        if group["amsgrad"] and "max_exp_avg_sq_codes" not in opt_ref.state[ref]:
            continue  # (amsgrad state layouts differ between the groups: covered by the 32-bit test)
        opt.step()
        opt_ref.step()
        got = mw.join24(p.detach(), opt.state[p][MASTER_CORRECTION])
        s = mw.correction_scale(p.detach())
        assert ((got - ref.detach()).abs() <= s).all(), "24-bit master outside its bound"


def test_master16_keeps_updates_that_round_away_without_it():
    """Updates far below a bfloat16 step vanish with master_bits=None; stochastic rounding keeps
    them on average (the mean over a tensor moves by about the summed updates)."""
    torch.manual_seed(0)
    moved = {}
    for bits in (None, 16):
        p = torch.nn.Parameter(torch.ones(64, 256, dtype=torch.bfloat16))
        opt = coatstate.CompressedAdamW([p], lr=1e-4, weight_decay=0.0, fused=False, master_bits=bits)
        for _ in range(40):
            p.grad = torch.ones_like(p)  # Adam's step is about lr per element, 1/78 of an ulp at 1.0
            opt.step()
        moved[bits] = 1.0 - p.float().mean().item()
    assert moved[None] == 0.0, "without a master, updates below half an ulp vanish"
    assert abs(moved[16] - 40 * 1e-4) < 0.25 * 40 * 1e-4, f"stochastic rounding moved {moved[16]:.2e}"


@pytest.mark.parametrize("bits", [24, 16])
def test_fused_master_step_tracks_the_twin(bits):
    """Fused (compiled on CUDA, Triton's interpreter on CPU) against the twin: weights within one
    bfloat16 step where an FP8 code flip or an approximate division moves the float32 update."""
    a, opt_a = _one_step(bits, fused=False)
    b, opt_b = _one_step(bits, fused=True)
    for pa, pb in zip(a, b, strict=True):
        wa, wb = pa.detach().float().cpu(), pb.detach().float().cpu()
        ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(wa.abs(), wb.abs()).clamp(min=2**-126))) - 7)
        assert ((wa - wb).abs() <= ulp).all(), "fused and twin weights differ by more than a bfloat16 step"
        same = (wa == wb).float().mean().item()
        assert same > 0.95, f"only {same:.3f} of the weights agree bit for bit"


def test_master_state_is_saved_and_resumes_bit_for_bit(tmp_path):
    half, opt = _one_step(24, fused=False)
    url = str(tmp_path / "m.safetensors")
    coatstate.save(opt, url)
    header = coatstate.checkpoint.read_header(url)
    assert any(MASTER_CORRECTION in k for k in header["tensors"]) or "master_correction" in str(header)
    copy = [torch.nn.Parameter(p.detach().clone()) for p in half]
    opt2 = coatstate.CompressedAdamW(
        _groups(copy), lr=1e-2, min_numel=1, compress_1d=True, fused=False, master_bits=24
    )
    coatstate.load(opt2, url)
    for grads in _grads(_shapes(), 2, seed=9):
        for params, o in ((half, opt), (copy, opt2)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(DEVICE)
            o.step()
    for p, q in zip(half, copy, strict=True):
        assert torch.equal(p, q) and torch.equal(
            opt.state[p][MASTER_CORRECTION], opt2.state[q][MASTER_CORRECTION]
        )


def test_state_bytes_count_the_correction():
    half, opt = _one_step(24, fused=False)
    n = sum(p.numel() for p in half)
    with_correction = coatstate.optim.optimizer_state_bytes(opt)
    half32, opt32 = _one_step(32, fused=False)
    assert coatstate.optim.optimizer_state_bytes(opt32) - with_correction == n  # int16 vs int8


# ---------------------------------------------------------------------------- gradient release
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(DEVICE)


@pytest.mark.parametrize("master_bits", [None, 32])
def test_gradient_release_equals_the_ordinary_step(master_bits):
    dtype = torch.bfloat16 if master_bits else torch.float32
    a, b = _model().to(dtype), _model().to(dtype)
    kw = dict(lr=1e-2, min_numel=1, master_bits=master_bits)
    opt_a = coatstate.CompressedAdamW(a.parameters(), **kw)
    opt_b = coatstate.CompressedAdamW(b.parameters(), gradient_release=True, **kw)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 2, 0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 2, 0.5)
    for _ in range(6):
        x = torch.randn(8, 32, device=DEVICE, dtype=dtype)
        for model, opt, sched in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert all(p.grad is None for p in b.parameters()), "released gradients must be freed"
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_gradient_release_clips_by_the_previous_norm():
    m = _model()
    opt = coatstate.CompressedAdamW(m.parameters(), lr=1e-2, gradient_release=True, max_grad_norm=1e-3)
    for _ in range(2):
        m(torch.randn(8, 32, device=DEVICE)).square().mean().backward()
        opt.step()
    assert opt._release.previous_norm is not None and opt._release.previous_norm.item() > 1e-3


def test_refused_combinations_say_why():
    m = _model()
    with pytest.raises(ValueError, match="bfloat16"):
        coatstate.CompressedAdamW(m.to(torch.float16).parameters(), master_bits=24)
    with pytest.raises(ValueError, match="master_bits must be"):
        coatstate.CompressedAdamW(_model().parameters(), master_bits=8)
    with pytest.raises(ValueError, match="gradient_release"):
        coatstate.CompressedAdamW(_model().parameters(), max_grad_norm=1.0)
    m = _model()
    opt = coatstate.CompressedAdamW(m.parameters(), gradient_release=True)
    m(torch.randn(4, 32, device=DEVICE)).sum().backward()
    with pytest.raises(RuntimeError, match="accumulation"):
        m(torch.randn(4, 32, device=DEVICE)).sum().backward()
    opt.grad_scale = torch.tensor(2.0)
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step()


def test_cast_model_keeps_norms_in_float32_and_trains_with_a_master():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    coatstate.cast_model(model)
    assert model[0].weight.dtype == model[2].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32
    opt = coatstate.CompressedAdamW(model.parameters(), lr=1e-2, min_numel=1, master_bits=24, fused=False)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        out = model(torch.randn(4, 32, dtype=torch.bfloat16))
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert (
        MASTER_CORRECTION in opt.state[model[0].weight]
        and MASTER_CORRECTION not in opt.state[model[1].weight]
    )
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        coatstate.cast_model(model, torch.float32)


def test_bfloat16_parameters_default_to_a_24_bit_master(caplog):
    """master_bits="auto": 24 for a bfloat16 group (the GPU parity run's choice), None for float32
    and float16 groups; an explicit None keeps the rounding path and says so once."""
    bf16 = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    fp32, fp16 = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64).half())
    opt = coatstate.CompressedAdamW([{"params": [bf16]}, {"params": [fp32]}, {"params": [fp16]}], min_numel=1)
    assert [g["master_bits"] for g in opt.param_groups] == [24, None, None]
    bf16.grad = torch.randn(64, 64).to(torch.bfloat16)
    opt.step()
    assert opt.state[bf16][MASTER_CORRECTION].dtype == torch.int8
    with caplog.at_level("INFO", logger="coatstate"):
        coatstate.CompressedAdamW([bf16], master_bits=None)
    assert "without master_bits" in caplog.text


# ------------------------------------------------------------- weights written outside the optimizer
def _write(model, weights, how):
    if how == "load_state_dict":
        model.load_state_dict(weights)
    elif how == "no_grad_copy":
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
    else:  # an EMA-style swap: the parameter now holds another tensor
        for name, p in model.named_parameters():
            p.data = weights[name].clone()


@pytest.mark.parametrize(
    ("bits", "fused", "release", "how"),
    [
        (24, False, False, "load_state_dict"),
        (32, False, False, "no_grad_copy"),
        (24, False, False, "data_swap"),
        (24, False, True, "no_grad_copy"),
        (24, True, False, "no_grad_copy"),
        (32, True, True, "load_state_dict"),
    ],
    ids=["24-load", "32-copy", "24-swap", "24-release-copy", "24-fused-copy", "32-fused-release-load"],
)
def test_weights_written_outside_drop_the_stale_correction(bits, fused, release, how):
    """After new weights are written in, the step equals a fresh optimizer's on those weights
    (same moments, no correction), bit for bit; without the check it rebuilt new weight + old
    correction as the master."""
    kw = dict(lr=1e-2, min_numel=1, master_bits=bits, fused=fused, gradient_release=release)
    model = _model().to(torch.bfloat16)
    opt = coatstate.CompressedAdamW(model.parameters(), **kw)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 32, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2)]
    model(xs[0]).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert all(s[MASTER_CORRECTION].any() for s in opt.state.values()), "a correction to go stale"
    new = {k: v.clone() for k, v in _model(seed=5).to(torch.bfloat16).state_dict().items()}
    fresh_model = _model(seed=5).to(torch.bfloat16)
    fresh = coatstate.CompressedAdamW(fresh_model.parameters(), **kw)
    state = copy.deepcopy(opt.state_dict())  # the moments as they are, no correction
    for s in state["state"].values():
        s[MASTER_CORRECTION] = torch.zeros_like(s[MASTER_CORRECTION])
    fresh.load_state_dict(state)
    _write(model, new, how)
    for m, o in ((model, opt), (fresh_model, fresh)):
        m(xs[1]).float().square().mean().backward()
        o.step()
        o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: the step used the correction of the old weight"
        assert torch.equal(opt.state[p][MASTER_CORRECTION], fresh.state[q][MASTER_CORRECTION]), name


def test_gradient_release_notes_once_how_to_clip(monkeypatch):
    """Issue #49: users who never clip saw a warning on every construction; it is now a note,
    once per process, and never with max_grad_norm."""
    from coatstate.optim import release

    monkeypatch.setattr(release, "_noted", False)
    m = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with max_grad_norm the user clips the way release can
        coatstate.CompressedAdamW(m.parameters(), gradient_release=True, max_grad_norm=1.0)
    with pytest.warns(UserWarning, match="note .shown once.") as caught:
        coatstate.CompressedAdamW(m.parameters(), gradient_release=True)
    assert caught[0].filename == __file__, "the note points at the user's constructor call"
    assert "max_grad_norm=" in str(caught[0].message) and "clip_grad_norm_" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second optimizer: no repeat
        coatstate.CompressedAdamW(m.parameters(), gradient_release=True)


@pytest.mark.parametrize("exp_avg_format", ["e4m3", "e2m1"])
def test_fused_24_bit_split_and_join_are_the_twins_at_every_exponent(exp_avg_format):
    """lr = 0: the fused step rebuilds each master and splits it again, so weight and correction
    must come back as the twin's, bit for bit, over every normal bfloat16 exponent field (the
    clamp at 16, the largest finite, Inf) and random corrections. The kernel derives s
    and 1 / s from the float32 pattern's exponent field in place; this catches any slip."""
    gen = torch.Generator().manual_seed(3)
    n = 64 * 128
    bits = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int32)
    bits = bits.to(torch.int16)
    corr = torch.randint(-128, 128, (64, 128), generator=gen, dtype=torch.int8)
    grad = (torch.randn(64, 128, generator=gen) * 1e-2).to(torch.bfloat16)
    outs = []
    for fused in (False, True):
        p = torch.nn.Parameter(bits.view(torch.bfloat16).reshape(64, 128).clone().to(DEVICE))
        opt = coatstate.CompressedAdamW([p], lr=0.0, weight_decay=0.0, min_numel=1, fused=fused,
                                        master_bits=24, exp_avg_format=exp_avg_format)  # fmt: skip
        p.grad = torch.zeros_like(p)
        opt.step()  # creates the correction (zeros)
        opt.state[p][MASTER_CORRECTION].copy_(corr.to(DEVICE))
        p.grad = grad.to(DEVICE)
        opt.step()
        outs.append((p.detach().cpu().view(torch.int16), opt.state[p][MASTER_CORRECTION].cpu()))
    (w0, c0), (w1, c1) = outs
    # (left out: NaN payloads and subnormal weights in or out, where the twin and the interpreter
    # already differed before the exponent arithmetic moved in place: a separate question)
    field = lambda w: (w.int() >> 7) & 0xFF  # noqa: E731
    keep = (field(bits.reshape(64, 128)) > 0) & (field(w0) > 0) & (field(w1) > 0) & (w0.float().abs() != 0)
    keep &= ~torch.isnan(w0.view(torch.bfloat16)) & ~torch.isnan(bits.view(torch.bfloat16).reshape(64, 128))
    assert keep.float().mean() > 0.9 and (field(bits[keep.flatten()]) < 16).any()
    assert torch.equal(w0[keep], w1[keep]), "fused weights differ from the twin's"
    assert torch.equal(c0[keep], c1[keep]), "fused corrections differ from the twin's"


@triton.jit
def _bf16_mismatches(out_ptr, BLOCK: tl.constexpr):
    bits = (tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
    x = bits.to(tl.float32, bitcast=True)
    pair = _to_bf16(x).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).to(tl.int32)  # the twin's
    nan_out = ((pair & 0x7F80) == 0x7F80) & ((pair & 0x7F) != 0)
    wrong = tl.where(x == x, pair != rounded, ~nan_out)
    tl.store(out_ptr + tl.program_id(0), tl.sum(wrong.to(tl.int32), axis=0))


@requires_cuda
@pytest.mark.gpu
def test_fused_24_bit_weight_rounding_is_the_twins_at_every_float32():
    """Exhaustive: the fused step's bfloat16 weights come from the paired conversion
    (cvt.rn.bf16x2.f32), which must give the twin's integer rounding at every non-NaN float32
    (subnormals, binade carries and overflow to Inf included) and a NaN for a NaN."""
    block = 1 << 13
    out = torch.empty(2**32 // block, dtype=torch.int32, device="cuda")
    _bf16_mismatches[(out.numel(),)](out, block)
    assert out.sum().item() == 0
