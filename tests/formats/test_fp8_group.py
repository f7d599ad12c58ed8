"""The FP8 group format: round trips within the documented bound, edge cases, slicing, size."""

import math

import pytest
import torch
from coatstate.formats import (
    FP8Format,
    GroupQuantized,
    dequantize,
    error_bound,
    quantize,
    round_to_fp8_grid,
    storage_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPES = [(), (1,), (5,), (3, 129), (7, 1000), (2, 3, 4, 5), (0, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random(shape, dtype, spread=3.0):
    x = torch.randn(shape) * torch.exp(torch.randn(shape) * spread)
    x[torch.rand(shape) < 0.1] = 0.0  # groups with zeros in them
    return x.clamp(-6e4, 6e4).to(dtype)


def _check_within_bound(q, x):
    got = dequantize(q)
    ref = x.float()
    assert torch.isfinite(got).all(), "dequantize produced NaN/Inf"
    err = (got - ref).abs()
    bound = error_bound(q, ref)
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"error exceeds bound by {worst:.3e} (max err {err.max().item():.3e})"
    assert torch.equal(got[ref == 0], torch.zeros_like(got[ref == 0])), "zeros are not exact"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expand", [False, True], ids=["plain", "expand"])
def test_round_trip_within_bound(shape, dtype, fmt, expand):
    x = _random(shape, dtype)
    q = quantize(x, group_size=128, fmt=fmt, expand=expand)
    assert q.codes.shape == x.shape and q.codes.dtype == FP8Format(fmt).dtype
    _check_within_bound(q, x)
    assert dequantize(q, dtype).dtype == dtype


def test_round_to_fp8_grid_matches_torch_cast():
    for fmt in FP8Format:
        x = torch.randn(200_000) * torch.exp(torch.randn(200_000) * 6)
        x = torch.cat([x.clamp(-fmt.max, fmt.max), torch.tensor([0.0, -0.0, 127.2, 2**-10, 3 * 2**-11])])
        ours = round_to_fp8_grid(x, fmt).to(fmt.dtype).view(torch.uint8)
        theirs = x.to(fmt.dtype).view(torch.uint8)
        assert torch.equal(ours, theirs), f"{fmt}: {(ours != theirs).sum()} codes differ"


@pytest.mark.parametrize("expand", [False, True])
def test_edge_case_groups(expand):
    tiny = 2.0**-15  # FP8 subnormal territory after scaling
    rows = [
        [0.0] * 8,  # all zero
        [0.0, 1.0, 0.0, -2.0, 0.0, 3.0, 0.0, 0.0],  # zeros inside
        [0.7] * 8,  # all equal
        [-0.7, 0.7, 0.7, -0.7, 0.7, 0.7, 0.7, 0.7],  # equal magnitudes, signs differ
        [1e30, 1e-30, -1e-20, 1.0, 0.0, 1e-38, 3e38, -3e38],  # huge ratio
        [tiny, 2 * tiny, 3 * tiny, 1.0, tiny, tiny, tiny, tiny],
    ]
    x = torch.tensor(rows)
    q = quantize(x, group_size=8, expand=expand)
    _check_within_bound(q, x)
    got = dequantize(q)
    assert torch.equal(got[0], torch.zeros(8))
    torch.testing.assert_close(got[2], x[2], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[3], x[3], rtol=1e-5, atol=0)


def test_one_element_groups():
    x = torch.tensor([[3.5], [-1e-20], [0.0], [7e37]])
    for expand in (False, True):
        q = quantize(x, group_size=1, expand=expand)
        torch.testing.assert_close(dequantize(q), x, rtol=1e-5, atol=0)


def test_exponent_range_is_clamped():
    x = torch.tensor([[1.0, 1.0 + 2**-20], [1e-38, 3e38]])
    q = quantize(x, group_size=2, expand=True)
    assert q.exponents.tolist() == [[255], [1]]


def test_non_finite_input_is_reported():
    x = torch.ones(4, 8)
    x[1, 2] = float("nan")
    x[3, 3] = float("inf")
    with pytest.raises(ValueError, match=r"shape \(4, 8\) with 2 non-finite"):
        quantize(x)


def test_bad_arguments_name_the_problem():
    with pytest.raises(TypeError, match="int64"):
        quantize(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quantize(torch.ones(3), fmt="e3m4")
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.ones(3), group_size=0)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.just(0.0),
            st.floats(allow_nan=False, allow_infinity=False, width=32),
            st.floats(min_value=2.0**-30, max_value=2.0**-5, width=32),
        ),
        min_size=1,
        max_size=40,
    ),
    group_size=st.sampled_from([1, 3, 16, 128]),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    expand=st.booleans(),
)
def test_property_any_finite_input(values, group_size, fmt, expand):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    q = quantize(x, group_size=group_size, fmt=fmt, expand=expand)
    _check_within_bound(q, x)
    if q.exponents is not None:
        assert int(q.exponents.min()) >= 1


@pytest.mark.parametrize("expand", [False, True])
def test_slice_on_dim0_equals_quantized_slice(expand):
    x = _random((9, 300), torch.float32)
    q = quantize(x, expand=expand)
    part = q[2:7]
    direct = quantize(x[2:7], expand=expand)
    assert torch.equal(part.codes.view(torch.uint8), direct.codes.view(torch.uint8))
    assert torch.equal(part.scales, direct.scales)
    if expand:
        assert torch.equal(part.exponents, direct.exponents)


def test_flat_round_trip_is_lossless():
    q = quantize(_random((5, 200), torch.float32), group_size=64, fmt="e5m2", expand=True)
    tensors, header = q.to_flat()
    back = GroupQuantized.from_flat(tensors, header)
    assert torch.equal(dequantize(back), dequantize(q))
    assert header == {"shape": [5, 200], "group_size": 64, "format": "e5m2", "expand": True}
    with pytest.raises(ValueError, match="missing"):
        GroupQuantized.from_flat({"codes": q.codes}, header)


def test_storage_per_element():
    x = torch.randn(4096, 4096)
    q = quantize(x)
    per_elem = q.nbytes / x.numel()
    print(f"\nstorage: {per_elem:.4f} bytes/element (codes + scales + exponents)")
    assert per_elem <= 1.07
    assert q.nbytes == storage_bytes(x.shape)


def _adam_like_states(n_groups=2048, group=128, seed=0):
    """Signed heavy-tailed m and v = squares spanning 1e-12..1e-2, rows of varying magnitude."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.empty(n_groups, 1).uniform_(-20, -4, generator=g))
    grads = torch.distributions.StudentT(3.0).sample((n_groups, group)) * row_scale
    m = grads * 0.5 + torch.randn(n_groups, group, generator=g) * row_scale * 0.1
    v = (grads * grads).clamp(1e-12, 1e-2) + 1e-12
    return m, v


def test_expansion_lowers_update_error():
    m, v = _adam_like_states()
    eps = 1e-8  # AdamW's default: the update it takes is m / (sqrt(v) + eps)
    ref = m / (v.sqrt() + eps)

    def mse(expand):
        mq = dequantize(quantize(m, expand=expand))
        vq = dequantize(quantize(v, expand=expand))
        return ((mq / (vq.sqrt() + eps) - ref) ** 2).mean().item()

    plain, expanded = mse(False), mse(True)
    ratio = plain / expanded
    print(f"\nMSE of m/sqrt(v): E4M3 {plain:.4g}, E4M3+expansion {expanded:.4g}, ratio {ratio:.2f}x")
    assert math.isfinite(ratio) and ratio >= 1.4
