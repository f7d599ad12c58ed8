"""The saved-activation codec: Triton kernels vs their pure-torch twins, error sizes, NaN groups.

Kernel checks run the Triton kernels under TRITON_INTERPRET=1 in a subprocess (the variable
must be set before triton is imported) and compare them with the pure-torch twins BIT FOR BIT:
both round onto the FP8 grid (and onto bfloat16 when unpacking to it) in float32 before the
cast, and use correctly rounded divisions, so the interpreter's non-RNE casts never round.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from coatstate.formats import activation as codec

from tests.conftest import child_env, requires_cuda

ROOT = Path(__file__).resolve().parents[2]


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from coatstate.kernels import activation as K
    from coatstate.formats import activation as T
    from tests.kernels.test_activation_kernels import same_bits
    torch.manual_seed(0)
    bad = []
    for fmt in ["e4m3", "e5m2"]:
        for dt in [torch.float32, torch.bfloat16, torch.float16]:
            for shape in [(1, 1), (3, 129), (7, 1000), (6, 40), (0, 5), (4, 0), (1, 9000), (5, 8)]:
                x = (torch.randn(shape) * torch.exp(torch.randn(shape) * 2)).to(dt)
                if x.numel() > 40:
                    x.view(-1)[:17] = 0  # an all-zero group
                if x.numel() > 100:  # non-finite input: its group unpacks to NaN
                    x.view(-1)[50], x.view(-1)[90] = float("inf"), float("nan")
                c, s = K.pack_tensor(x.reshape(-1), fmt)
                c2, s2 = T.pack_tensor(x.reshape(-1), fmt)
                if not (same_bits(c, c2) and torch.equal(s, s2)):
                    bad.append(("pack_tensor", fmt, dt, shape))
                if not same_bits(K.unpack_tensor(c, s, dt), T.unpack_tensor(c2, s2, dt)):
                    bad.append(("unpack_tensor", fmt, dt, shape))
                c, s = K.pack_groups(x, 16, fmt)
                c2, s2 = T.pack_groups(x, 16, fmt)
                if not (same_bits(c, c2) and torch.equal(s, s2)):
                    bad.append(("pack_groups", fmt, dt, shape))
                if not same_bits(K.unpack_groups(c, s, 16, dt), T.unpack_groups(c2, s2, 16, dt)):
                    bad.append(("unpack_groups", fmt, dt, shape))
    # FP8Linear's GEMM operands: per-tensor float32 scale, twin formats.tensorwise
    from coatstate.formats import tensorwise
    from coatstate.kernels import tensorwise as KT
    for dt in [torch.float32, torch.bfloat16]:
        for shape in [(1,), (3, 129), (7, 1000), (9000,)]:
            x = (torch.randn(shape) * torch.exp(torch.randn(shape) * 2)).to(dt)
            c, s = KT.pack_tensorwise(x)
            c2, s2 = tensorwise.quantize_tensorwise(x)
            if not (same_bits(c, c2) and torch.equal(s[0], s2)):
                bad.append(("pack_tensorwise (float32 scale)", dt, shape))
            if not same_bits(KT.unpack_tensorwise(c, s, dt), tensorwise.dequantize_tensorwise(c2, s2, dt)):
                bad.append(("unpack_tensorwise (float32 scale)", dt, shape))
    # the whole hook path on the kernels (backend="triton") equals the twin path bit for bit
    from coatstate.models import GPT, ModelConfig
    from coatstate.activations import compress_activations
    model = GPT(ModelConfig(vocab=64, layers=1, dim=32, heads=2, seq=16))
    idx = torch.randint(0, 64, (2, 16))
    grads = []
    for backend in ["torch", "triton"]:
        model.zero_grad()
        with compress_activations(backend=backend, min_numel=0) as ctx:
            loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    if ctx.stats.packed == 0 or not all(torch.equal(a, b) for a, b in zip(*grads)):
        bad.append(("model grads triton vs torch", ctx.stats.packed))
    print("mismatches:", bad)
    sys.exit(1 if bad else 0)
    """
)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads differ between devices)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point and a.dtype.itemsize > 1:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.equal(a.view(ints), b.view(ints))


def test_kernels_match_twin_bit_for_bit_in_interpreter():
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT],
        cwd=ROOT,
        env=child_env(TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(run.stdout[-2000:])
    assert run.returncode == 0, f"kernel/twin mismatch or crash:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


def test_twin_round_trip_error_is_fp8_sized():
    x = torch.randn(64, 256) * torch.exp(torch.randn(64, 1))
    codes, scale = codec.pack_tensor(x)
    rel = (codec.unpack_tensor(codes, scale, torch.float32) - x).norm() / x.norm()
    gcodes, gscales = codec.pack_groups(x, 16)
    grel = (codec.unpack_groups(gcodes, gscales, 16, torch.float32) - x).norm() / x.norm()
    print(f"relative L2 error: per-tensor {rel:.4f}, per-group {grel:.4f}")
    assert rel < 0.04 and grel < 0.04  # E4M3 rounds within 2**-4 relative; typical L2 ~0.02
    assert gscales.shape == (64, 16) and gscales.dtype == torch.uint8


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_power_of_two_scales_never_saturate_and_err_within_half_a_step(fmt):
    """Each group's scale is the smallest power of two that fits its max: max/scale lies in
    (FP8_MAX/2, FP8_MAX], and every value is within half an FP8 step of its code (relative
    2**-(m+1) for normal codes, half the subnormal spacing below)."""
    f = codec.FP8Format.parse(fmt)
    x = torch.randn(300, 48) * torch.exp(torch.randn(300, 1) * 4)
    x[0] = 0.0  # all-zero row: exact zeros
    x[1, :16] = f.max * 2.0**5  # a max exactly on FP8_MAX * 2**e: no rounding up of the scale
    codes, scales = codec.pack_groups(x, 16, fmt)
    scale = (scales.int() << 23).view(torch.float32).repeat_interleave(16, dim=1)
    q = codes.float()
    ratio = (x.abs().reshape(300, 3, 16).amax(-1) / scale[:, ::16])[2:]
    assert ratio.max() <= f.max and ratio.min() > f.max / 2, (ratio.min(), ratio.max())
    assert scales[1, 0] == 127 + 5 and q[1, :16].eq(f.max).all()
    out = codec.unpack_groups(codes, scales, 16, torch.float32)
    u = 2.0 ** -(f.mantissa_bits + 1)
    bound = torch.maximum(x.abs() * u, scale * 2.0 ** (f.min_normal_exponent - f.mantissa_bits - 1))
    err = (out - x).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3f}"
    assert out[0].eq(0).all()


def test_non_finite_group_unpacks_to_nan_and_sizes():
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    codes, scales = codec.pack_groups(x, 16)
    out = codec.unpack_groups(codes, scales, 16, torch.float32)
    nan_groups = out.reshape(2, 4, 16).isnan().all(-1)
    assert nan_groups.tolist() == [[True, False, False, False], [False, False, True, False]]
    assert codes.numel() + scales.numel() == x.numel() * (1 + 1 / 16)  # 1.0625 bytes per element
    c, s = codec.pack_tensor(x)
    assert s.item() == codec.NAN_SCALE and codec.unpack_tensor(c, s, torch.float32).isnan().all()


@pytest.mark.gpu
@requires_cuda
def test_kernels_bit_exact_on_gpu():
    """Compiled kernels vs the twin run on the same GPU tensors: bit for bit."""
    from coatstate.kernels import activation as K

    for dt, shape, _ in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), [(37, 1000), (4096, 1024), (3, 129)], range(2)
    ):  # the second call of each reuses the compiled kernel (kernels.activation._Launcher)
        x = (torch.randn(shape, device="cuda") * torch.exp(torch.randn(shape, device="cuda") * 2)).to(dt)
        c, s = K.pack_tensor(x)
        c2, s2 = codec.pack_tensor(x)
        assert same_bits(c, c2) and torch.equal(s, s2), (dt, shape)
        assert same_bits(K.unpack_tensor(c, s, dt), codec.unpack_tensor(c2, s2, dt)), (dt, shape)
        gc_, gs = K.pack_groups(x, 16)
        gc2, gs2 = codec.pack_groups(x, 16)
        assert same_bits(gc_, gc2) and torch.equal(gs, gs2), (dt, shape)
        out, want = K.unpack_groups(gc_, gs, 16, dt), codec.unpack_groups(gc2, gs2, 16, dt)
        assert same_bits(out, want), (dt, shape)
    from coatstate.formats import tensorwise
    from coatstate.kernels import tensorwise as KT

    for dt in (torch.float32, torch.bfloat16):  # FP8Linear's float32-scale operands
        x = (torch.randn(37, 1000, device="cuda") * 3).to(dt)
        c, s = KT.pack_tensorwise(x)
        # the twin on the CPU: on CUDA, torch turns formats.tensorwise's `amax / FP8_MAX` (a Python
        # float divisor) into a multiply by its reciprocal, which can round the scale differently
        c2, s2 = tensorwise.quantize_tensorwise(x.cpu())
        assert same_bits(c, c2) and torch.equal(s[0].cpu(), s2), dt
    print(f"reuse of compiled kernels: mode {K._Launcher.mode} (2: direct, 1: CompiledKernel[grid], 0: off)")
