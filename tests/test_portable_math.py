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


def test_log2_is_the_correctly_rounded_value():
    x = torch.cat([_random_magnitudes(200_000, 0), torch.tensor([1e-45, 1e-40, 1.0, 2.0, 0.5, 3.4e38])])
    want = torch.tensor([math.log2(v) for v in x.double().tolist()], dtype=torch.float64).float()
    got = portable_math.log2(x)
    bad = (got != want).sum().item()
    assert bad == 0, f"{bad} of {x.numel()} log2 values differ from the correctly rounded float32"


def test_exp2_is_the_correctly_rounded_value():
    gen = torch.Generator().manual_seed(1)
    y = torch.cat([torch.randn(200_000, generator=gen) * 50, torch.tensor([-149.0, -150.0, -126.0, 127.99, 0.0])])
    want = torch.tensor([2.0**v for v in y.double().tolist()], dtype=torch.float64).float()
    got = portable_math.exp2(y)
    bad = (got != want).sum().item()
    assert bad == 0, f"{bad} of {y.numel()} exp2 values differ from the correctly rounded float32"


def test_special_values():
    x = torch.tensor([0.0, -1.0, math.inf, math.nan])
    assert portable_math.log2(x).tolist()[:3] == [-math.inf, pytest.approx(math.nan, nan_ok=True), math.inf]
    assert math.isnan(portable_math.log2(x)[1]) and math.isnan(portable_math.log2(x)[3])
    y = portable_math.exp2(torch.tensor([-math.inf, math.inf, math.nan, 300.0, -300.0]))
    assert y[0] == 0 and y[1] == math.inf and math.isnan(y[2]) and y[3] == math.inf and y[4] == 0


def test_exact_path_agrees_with_the_fast_one():
    """The exact-arithmetic fallback decides only near rounding boundaries; everywhere else it must
    round the same way, or the choice of path would itself change bits."""
    x = _random_magnitudes(100_000, 2)
    assert torch.equal(portable_math._exact_log2(x.double()).float(), portable_math.log2(x))
    y = torch.randn(100_000, generator=torch.Generator().manual_seed(3)) * 60
    assert torch.equal(portable_math._exact_exp2(y.double()).float(), portable_math.exp2(y))


def test_a_value_does_not_depend_on_its_position():
    """torch's vectorized loop body and scalar tail round differently; ours must not."""
    x = _random_magnitudes(4099, 4)
    whole = portable_math.log2(x)
    for start in (0, 1, 3, 7, 15, 17):
        assert torch.equal(portable_math.log2(x[start:start + 9]), whole[start:start + 9])
        assert torch.equal(portable_math.exp2(whole[start:start + 9]), portable_math.exp2(whole)[start:start + 9])


_DIGEST = """
import hashlib, torch
from coatstate.formats import quantize
gen = torch.Generator().manual_seed(0)
h = hashlib.sha256()
for shape in ((1,), (3, 129), (7, 1000), (64, 300)):
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 6).exp().float() * torch.randn(shape, generator=gen).sign()
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
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, check=True)
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
