"""4-bit group codecs (formats/fp4.py): exact grid values round trip, rounding to the nearest
level with ties to even, zero-free codebooks never decode a nonzero value to zero, rows stay
independent (dim-0 slices), and bad input is refused."""

from __future__ import annotations

import pytest
import torch
from coatstate.formats.fp4 import CODEBOOKS, ZERO_FREE, dequantize_fp4, quantize_fp4, storage_bytes_fp4

SHAPES = [(1,), (3, 129), (7, 1000), (0, 5), (4, 2, 33)]


def _round_trip(x, codebook, group_size=128):
    packed, scales = quantize_fp4(x, group_size=group_size, codebook=codebook)
    return (
        packed,
        scales,
        dequantize_fp4(packed, scales, tuple(x.shape), group_size=group_size, codebook=codebook),
    )


@pytest.mark.parametrize("codebook", list(CODEBOOKS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codebook_values_round_trip_exactly_and_bytes_are_as_counted(codebook, shape):
    g = torch.Generator().manual_seed(0)
    levels, signed = torch.tensor(CODEBOOKS[codebook][0]), CODEBOOKS[codebook][1]
    idx = torch.randint(0, len(levels), shape, generator=g)
    x = levels[idx] * 3.0  # group scale 3 wherever the group holds the top level
    if signed:
        x = torch.where(torch.rand(shape, generator=g) < 0.5, -x, x)
    x.view(-1)[::128] = 3.0 if x.numel() else 0.0  # every group's max is exactly the scale
    packed, scales, y = _round_trip(x, codebook)
    assert torch.equal(y, x), f"max diff {(y - x).abs().max() if x.numel() else 0}"
    assert packed.dtype == torch.uint8 and packed.numel() + scales.numel() * 4 == storage_bytes_fp4(shape)


def test_e2m1_rounds_to_nearest_with_ties_to_even():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 4.9, -2.6])
    want = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 4.0, -3.0])  # ties: even code
    _, _, y = _round_trip(x, "e2m1")
    assert torch.equal(y, want), (y, want)
    assert set(y.abs().tolist()) <= set(grid.tolist())


@pytest.mark.parametrize("codebook", sorted(ZERO_FREE))
def test_zero_free_codebooks_never_decode_a_nonzero_value_to_zero(codebook):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(16, 256, generator=g) ** 8  # v-like: many tiny values beside a few large ones
    x[0, :128] = 0.0  # an all-zero group stays exactly zero
    x[1, 5] = 0.0  # a zero inside a nonzero group
    _, _, y = _round_trip(x, codebook)
    assert torch.equal(y[0, :128], torch.zeros(128))
    assert bool((y[x != 0] > 0).all()), "a nonzero value decoded to zero"
    plain = _round_trip(x, "e2m1")[2]
    assert bool((plain[x != 0] == 0).any()), "the test data must hold values e2m1 rounds to zero"


def test_rows_are_independent_so_dim0_slices_are_valid():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 300, generator=g)
    packed, scales, y = _round_trip(x, "e2m1", group_size=32)
    part = dequantize_fp4(packed[2:5], scales[2:5], (3, 300), group_size=32, codebook="e2m1")
    assert torch.equal(part, y[2:5])
    assert float(((y - x).norm() / x.norm()) ** 2) < 0.02  # E2M1 per group of 32 on Gaussian data


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown 4-bit codebook"):
        quantize_fp4(torch.ones(4), codebook="e3m0")
    with pytest.raises(ValueError, match="unsigned"):
        quantize_fp4(-torch.ones(4), codebook="linear_nz")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp4(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="group_size"):
        quantize_fp4(torch.ones(4), group_size=0)
