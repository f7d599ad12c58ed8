"""The 4-bit moment formats (formats/fp4_moment.py) and their options: exact levels round trip,
ue3m1_sqrt never decodes a value of a nonzero group to zero, ties go to the even code, odd rows
pack with a zero nibble, non-finite groups are NaN, and misuse is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from coatstate.formats.fp4 import CODEBOOKS
from coatstate.formats.fp4_moment import FP4Format, decode_moment, encode_moment
from coatstate.formats.optimizer_state import (
    MomentFormat,
    init_moment,
    parse_format,
    read_moment,
    write_moment,
)

from coatstate import CompressedAdamW


def test_ue3m1_levels_are_the_issue_s():
    levels = CODEBOOKS["ue3m1"][0]
    assert levels == tuple(m * 2.0**e for e in range(8) for m in (1.0, 1.5))
    assert levels[0] == 1.0 and levels[-1] == 192.0


@pytest.mark.parametrize("cols", [1, 2, 127, 128, 129, 300])
def test_sqrt_levels_round_trip_exactly_in_any_row_length(cols):
    g = torch.Generator().manual_seed(cols)
    levels = torch.tensor(CODEBOOKS["ue3m1"][0])
    u = levels[torch.randint(0, 16, (3, cols), generator=g)] / 192.0 * 8.0  # scale 8 where 192 occurs
    u[:, ::128] = 8.0
    packed, scales = encode_moment(u * u, 128, FP4Format.UE3M1_SQRT)
    assert packed.shape == (3, (cols + 1) // 2) and packed.dtype == torch.uint8
    if cols % 2:
        assert (packed[:, -1] >> 4 == 0).all(), "an odd row's last high nibble is 0"
    assert torch.equal(scales, torch.full_like(scales, 8.0))
    v = decode_moment(packed, scales, cols, 128, FP4Format.UE3M1_SQRT)
    assert torch.equal(v, u * u), f"max diff {(v - u * u).abs().max()}"


def test_sqrt_format_is_zero_free_and_zero_groups_stay_zero():
    v = torch.zeros(2, 256)
    v[0, 0] = 4.0  # group 0 of row 0 is nonzero; every other group is all zero
    packed, scales = encode_moment(v, 128, FP4Format.UE3M1_SQRT)
    out = decode_moment(packed, scales, 256, 128, FP4Format.UE3M1_SQRT)
    assert (out[0, :128] > 0).all(), "a zero in a nonzero group decodes to the smallest level"
    step = torch.tensor(2.0) / 192.0  # float32, as the codec
    assert out[0, 1].item() == (1.0 * step * step).item()
    assert torch.equal(out[0, 128:], torch.zeros(128)) and torch.equal(out[1], torch.zeros(256))


def test_ties_go_to_the_even_code():
    # u in units of scale/192: 1.25 lies between 1 (code 0) and 1.5 (code 1): even -> 1;
    # 1.75 between 1.5 (1) and 2 (2) -> 2; 160 between 128 (14) and 192 (15) -> 128
    units = torch.tensor([[192.0, 1.25, 1.75, 160.0, 2.5]])
    packed, scales = encode_moment(units * units, 128, FP4Format.UE3M1_SQRT)
    u = decode_moment(packed, scales, 5, 128, FP4Format.UE3M1_SQRT).sqrt()
    assert u.tolist() == [[192.0, 1.0, 2.0, 128.0, 2.0]]
    m = torch.tensor([[6.0, 0.25, 0.75, -2.5, 5.0]])
    packed, scales = encode_moment(m, 128, FP4Format.E2M1)
    assert decode_moment(packed, scales, 5, 128, FP4Format.E2M1).tolist() == [[6.0, 0.0, 1.0, -2.0, 4.0]]


@pytest.mark.parametrize("fmt", list(FP4Format))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_makes_its_group_nan(fmt, bad):
    x = torch.rand(1, 256) + 0.1
    x[0, 3] = bad
    packed, scales = encode_moment(x, 128, fmt)
    assert torch.isnan(scales[0, 0]) and torch.isfinite(scales[0, 1])
    out = decode_moment(packed, scales, 256, 128, fmt)
    assert torch.isnan(out[0, :128]).all() and torch.isfinite(out[0, 128:]).all()
    state = {}
    mf = MomentFormat(fmt, False, 128)
    name = "exp_avg" if fmt is FP4Format.E2M1 else "exp_avg_sq"
    init_moment(state, name, x, mf)
    write_moment(state, name, x, mf)
    read = read_moment(state, name, 128, mf, tuple(x.shape))
    if name == "exp_avg":
        assert read[0, :128].isnan().all()
    else:  # a second moment reads NaN as +Inf
        assert torch.equal(read[0, :128], torch.full((128,), float("inf")))


def test_moment_state_layout_and_4bit_relative_error():
    p = torch.randn(7, 2, 33)
    for fmt in FP4Format:
        mf = MomentFormat(fmt, False, 128)
        state = {}
        init_moment(state, "exp_avg", p, mf)
        assert state["exp_avg_codes"].shape == (7, 33) and state["exp_avg_scales"].shape == (7, 1)
        assert "exp_avg_exponents" not in state
        x = p if fmt.signed else p * p
        write_moment(state, "exp_avg", x, mf)
        y = read_moment(state, "exp_avg", 128, mf, tuple(p.shape))
        rel = ((y - x).norm() / x.norm()).item()
        assert rel < 0.2, f"{fmt.value}: relative error {rel}"  # 4 bits: about 1/8 of a group's max


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"exp_avg_sq_format": "e2m1"}, "use exp_avg_sq_format='ue3m1_sqrt'"),
        ({"exp_avg_format": "ue3m1_sqrt"}, "use exp_avg_format='e2m1'"),
        ({"exp_avg_format": "e2m1", "exp_avg_expand": True}, "pass exp_avg_expand=False"),
        ({"exp_avg_sq_format": "ue3m1_sqrt", "exp_avg_sq_expand": True}, "pass exp_avg_sq_expand=False"),
        ({"exp_avg_format": "e2m1", "group_size": 127}, "group_size must be even"),
        ({"exp_avg_format": "e3m0"}, "unknown moment format"),
    ],
)
def test_misuse_is_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressedAdamW([torch.nn.Parameter(torch.randn(64, 64))], **kwargs)


def test_expand_follows_the_format_unless_given():
    p = torch.nn.Parameter(torch.randn(64, 64))
    group = CompressedAdamW([p], exp_avg_format="e2m1", exp_avg_sq_format="ue3m1_sqrt").param_groups[0]
    assert group["exp_avg_expand"] is False and group["exp_avg_sq_expand"] is False
    group = CompressedAdamW([p], exp_avg_sq_format="ue3m1_sqrt").param_groups[0]
    assert group["exp_avg_expand"] is True and group["exp_avg_sq_expand"] is False
    assert parse_format("UE3M1_SQRT") is FP4Format.UE3M1_SQRT


@pytest.mark.parametrize(("fm", "fv"), [("e2m1", "ue3m1_sqrt"), ("e4m3", "ue3m1_sqrt"), ("e2m1", "e4m3")])
def test_4bit_moments_train_close_to_adamw_on_cpu(fm, fv):
    torch.manual_seed(0)
    w0 = torch.randn(96, 130) * 0.1
    x, y = torch.randn(512, 130), torch.randn(512, 96)
    losses = {}
    for kind in ("torch", "coat"):
        w = torch.nn.Parameter(w0.clone())
        if kind == "torch":
            opt = torch.optim.AdamW([w], lr=1e-2)
        else:
            opt = CompressedAdamW([w], lr=1e-2, exp_avg_format=fm, exp_avg_sq_format=fv, fused=False)
        for _ in range(60):
            loss = ((x @ w.T - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[kind] = loss.item()
    assert losses["coat"] < 1.05 * losses["torch"], losses


def _ema_ratio(stochastic: bool) -> float:
    """Geometric mean of v' / v after 150 steps of beta2 = 0.95 EMAs of shrinking gradients, v'
    stored in ue3m1_sqrt after every step (one steady element per row holds the group scale)."""
    from coatstate.formats.fp4_moment import FP4Format, decode_moment, encode_moment, rounding_bits

    fmt, rows, cols = FP4Format.UE3M1_SQRT, 32, 256
    gen = torch.Generator().manual_seed(0)
    amp = torch.rand(rows, cols, generator=gen) * 2 + 0.1
    exact, stored = torch.zeros(rows, cols), torch.zeros(rows, cols)
    for step in range(1, 151):
        g = torch.randn(rows, cols, generator=gen) * amp * 0.99**step
        g[:, 0] = 1.0
        exact = exact * 0.95 + 0.05 * g * g
        bits = rounding_bits(3, step, 0, rows, cols) if stochastic else None
        codes, scales = encode_moment(stored * 0.95 + 0.05 * g * g, 128, fmt, bits)
        stored = decode_moment(codes, scales, cols, 128, fmt)
    return float((stored[:, 1:] / exact[:, 1:]).log().mean().exp())


def test_stochastic_rounding_keeps_a_4bit_second_moment_tracking_its_ema():
    """Why the optimizer step rounds ue3m1_sqrt stochastically: rounded to the nearest level, a
    stored v cannot step down (0.95 * 1.5**2 stays above the midpoint 1.25**2), so as gradients
    shrink it stays far too large; rounded stochastically it follows the float EMA."""
    nearest, stochastic = _ema_ratio(False), _ema_ratio(True)
    assert nearest > 1.25, nearest
    assert 0.9 < stochastic < 1.1, stochastic


def test_stochastic_rounding_picks_a_neighbouring_level_unbiased_in_sqrt():
    from coatstate.formats.fp4 import CODEBOOKS
    from coatstate.formats.fp4_moment import FP4Format, decode_moment, encode_moment, rounding_bits

    fmt, rows, cols = FP4Format.UE3M1_SQRT, 16, 256
    v = torch.rand(rows, cols, generator=torch.Generator().manual_seed(1)).pow(4) + 1e-3
    v[:, 0] = v[:, 128] = 2.0  # each group's scale: sqrt(2) is the top level
    u = v.sqrt().double()
    units = u * 192 / 2**0.5
    levels = torch.tensor(CODEBOOKS["ue3m1"][0], dtype=torch.float64)
    lo = levels[(torch.bucketize(units, levels, right=True) - 1).clamp(0, 14)]
    total = torch.zeros_like(u)
    for step in range(1, 201):
        codes, scales = encode_moment(v, 128, fmt, rounding_bits(7, step, 0, rows, cols))
        got = decode_moment(codes, scales, cols, 128, fmt).double().sqrt() * 192 / 2**0.5
        upper = levels[(torch.bucketize(lo, levels) + 1).clamp(max=15)]
        assert (torch.isclose(got, lo, rtol=1e-5) | torch.isclose(got, upper, rtol=1e-5) | (units < 1)).all()
        total += got
    above = units >= 1  # below level 1 the zero-free codebook can only round up
    rel = (total / 200 / units)[above] - 1
    assert abs(float(rel.mean())) < 2e-3 and float(rel.abs().max()) < 0.1
    # the same seed, step and offsets give the same codes (a resumed run rounds as the original)
    again = encode_moment(v, 128, fmt, rounding_bits(7, 200, 0, rows, cols))[0]
    assert torch.equal(again, codes)


def test_rounding_bits_share_one_hash_a_pair_and_round_up_as_often_as_they_should():
    """Neighbours 2j, 2j + 1 take the low and high 16 bits of one hash32(offset // 2) (the fused
    step hashes once a pair); as the offset 64 r + 32 they round a 22-bit fraction f up with
    probability f / 2**22 to within 2**-17, and on average over f to within 2**-20."""
    from coatstate.formats.fp4_moment import ROUNDING_STREAM, rounding_bits
    from coatstate.formats.rounding_hash import hash32

    first, rows, cols = 2**32 - 40, 4, 64  # a run of offsets across 2**32
    bits = rounding_bits(5, 9, first, rows, cols).flatten()
    offsets = (torch.arange(first, first + rows * cols) & 0xFFFFFFFF)[0::2]
    h = hash32(5, 9, offsets >> 1, ROUNDING_STREAM)
    assert torch.equal(bits[0::2], ((h & 0xFFFF) << 6) | 32)
    assert torch.equal(bits[1::2], ((h >> 16) << 6) | 32)
    offsets_all = torch.arange(2**16, dtype=torch.int64) * 64 + 32  # every value the bits take
    frac = torch.arange(0, 2**22, 97, dtype=torch.int64)
    p_up = (2**16 - torch.searchsorted(offsets_all, 2**22 - frac)).double() / 2**16
    err = p_up - frac.double() / 2**22
    assert float(err.abs().max()) <= 2**-17 and abs(float(err.mean())) < 2**-20
