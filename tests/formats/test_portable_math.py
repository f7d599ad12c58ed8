"""The codec's log2/exp2 give the same float32 bits on every CPU code path (issue: AVX2 ulps)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from coatstate.formats import portable_math, quantize


def _random_magnitudes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * 12).exp().float()


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the float32 spacing at want (float64 want)."""
    # a normal float32 in [2^(e-1), 2^e) is spaced 2^(e - 24)
    spacing = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 24)
    return (got.double() - want).abs() / spacing


def test_log2_is_within_three_ulp_of_float64_math():
    x = torch.cat(
        [_random_magnitudes(200_000, 0), torch.tensor([1e-45, 1e-40, 1.17e-38, 1.0, 2.0, 0.5, 3.4e38])]
    )
    want = x.double().log2()  # float64 math: its error is 2**-29 of a float32 ulp
    ulps = _ulps(portable_math.log2(x), want)
    worst, worst_big = ulps.max().item(), ulps[want.abs() >= 1].max().item()
    # near x = 1 the result is tiny and its last bits come from s = (m - 1) / (m + 1)'s rounding
    assert worst <= 3.0, f"log2 is {worst:.3f} ulp off float64 math (bound: 3 ulp)"
    assert worst_big <= 1.25, f"log2 is {worst_big:.3f} ulp off where |log2 x| >= 1 (bound: 1.25 ulp)"


def test_exp2_is_within_1_25_ulp_of_float64_math():
    gen = torch.Generator().manual_seed(1)
    y = torch.cat(
        [
            (torch.randn(200_000, generator=gen) * 40).clamp(-126, 127.9),
            torch.tensor([-126.0, -100.5, 0.0, 0.5, 127.99]),
        ]
    )
    want = y.double().exp2()
    normal = want >= 2.0**-126  # below, one more rounding into the subnormals (checked apart)
    worst = _ulps(portable_math.exp2(y)[normal], want[normal]).max().item()
    assert worst <= 1.25, f"exp2 is {worst:.3f} ulp off float64 math (bound: 1.25 ulp)"


def test_exp2_rounds_once_into_the_subnormals():
    y = torch.tensor([-127.0, -130.0, -140.25, -149.0, -149.5, -150.0, -151.0, -200.0])
    got = portable_math.exp2(y)
    want = torch.tensor([2.0**v for v in y.double().tolist()], dtype=torch.float64).float()
    assert torch.equal(got[:4], want[:4]), (got, want)  # exact powers of two
    assert (got - want).abs().max().item() <= 2.0**-149, (got, want)  # within one subnormal step


def test_exact_powers_of_two():
    """log2 of 2^e is e and exp2 of an integer is 2^n, exactly: scales of powers of two survive."""
    e = torch.arange(-149, 128, dtype=torch.float32)
    assert torch.equal(portable_math.log2(portable_math.exp2(e)), e)
    assert torch.equal(portable_math.exp2(e), torch.tensor([2.0**v for v in e.tolist()], dtype=torch.float32))


def test_special_values():
    x = torch.tensor([0.0, math.inf, math.nan, 1e-45])
    got = portable_math.log2(x)
    assert got[0] == -math.inf and got[1] == math.inf and math.isnan(got[2]) and got[3] == -149
    y = portable_math.exp2(torch.tensor([-math.inf, math.inf, math.nan, 300.0, -300.0]))
    assert y[0] == 0 and y[1] == math.inf and math.isnan(y[2]) and y[3] == math.inf and y[4] == 0


def test_constants_are_float32():
    """The coefficients are float32 values (hex literals): the same numbers in the twin, C++ and Triton."""
    for c in (*portable_math.LOG2_COEFFICIENTS, *portable_math.EXP2_COEFFICIENTS, portable_math.SQRT2):
        assert torch.tensor(c, dtype=torch.float32).item() == c, c


def test_a_value_does_not_depend_on_its_position():
    """torch's vectorized loop body and scalar tail round differently; ours must not."""
    x = _random_magnitudes(4099, 4)
    whole = portable_math.log2(x)
    for start in (0, 1, 3, 7, 15, 17):
        assert torch.equal(portable_math.log2(x[start : start + 9]), whole[start : start + 9])
        assert torch.equal(
            portable_math.exp2(whole[start : start + 9]), portable_math.exp2(whole)[start : start + 9]
        )


_DIGEST = """
import hashlib, torch
from coatstate.formats import quantize
gen = torch.Generator().manual_seed(0)
h = hashlib.sha256()
for shape in ((1,), (3, 129), (7, 1000), (64, 300)):
    magnitude = (torch.randn(shape, generator=gen, dtype=torch.float64) * 6).exp().float()
    x = magnitude * torch.randn(shape, generator=gen).sign()
    for fmt in ("e4m3", "e5m2"):
        for expand in (True, False):
            q = quantize(x, fmt=fmt, expand=expand)
            h.update(bytes(q.codes.view(torch.uint8).flatten().tolist()))
            h.update(str(q.scales.flatten().view(torch.int32).tolist()).encode())
            if q.exponents is not None:
                h.update(bytes(q.exponents.flatten().tolist()))
print(torch.backends.cpu.get_cpu_capability(), h.hexdigest())
"""


def _capabilities() -> list[str]:
    """default, plus each vector width up to this CPU's own."""
    own = torch.backends.cpu.get_cpu_capability().lower()
    ladder = ["default", "avx2", "avx512"] if own.startswith("avx") else ["default", own]
    return ladder[: ladder.index(own) + 1] if own in ladder else ["default", own]


@pytest.mark.slow
def test_codec_bits_are_the_same_under_every_cpu_capability():
    digests = {}
    for cap in _capabilities():
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, check=True
        )
        seen_cap, digest = out.stdout.split()
        digests[f"{cap} (torch ran {seen_cap})"] = digest
    assert len(set(digests.values())) == 1, f"codec bits differ by CPU capability: {digests}"
    assert len(digests) >= 2, digests


def test_slicing_on_dim0_is_bit_exact_with_expansion():
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(33, 1000, generator=gen, dtype=torch.float64) * 6).exp().float()
    q = quantize(x, expand=True)
    for lo, hi in ((2, 7), (1, 2), (5, 33), (0, 17)):
        part, direct = q[lo:hi], quantize(x[lo:hi], expand=True)
        assert torch.equal(part.codes.view(torch.uint8), direct.codes.view(torch.uint8)), (lo, hi)
        assert torch.equal(part.scales, direct.scales), (lo, hi)
        assert torch.equal(part.exponents, direct.exponents), (lo, hi)
