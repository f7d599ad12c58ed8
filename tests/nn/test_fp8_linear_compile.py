"""FP8Linear under torch.compile: the traceable quantizer gives the eager codes and scales, a
compiled stack of FP8Linear layers (fullgraph, no graph breaks) computes the eager layer's bits,
and a compiled model trains with CompressedAdamW under compress_activations entered outside the
compiled call. CPU (inductor's C++ backend) here; the gpu test checks the Triton path."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from coatstate.formats import tensorwise
from coatstate.formats.fp8 import FP8Format
from coatstate.formats.group import MIN_SCALE
from torch import nn

import coatstate
from coatstate.nn import FP8LinearConfig, convert_to_fp8
from coatstate.nn import functional as fp8_linear
from tests.conftest import requires_cuda


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no recompile limit carried over from other shapes."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _scaled_mm_runs_on_cpu() -> bool:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(1), scale_b=torch.ones(1), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


_BACKENDS = ["emulate"] + (["scaled_mm"] if _scaled_mm_runs_on_cpu() else [])
pytestmark = pytest.mark.slow  # inductor compiles in every test


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One shape (one compilation) and values that reach every branch of the scale: ordinary,
    wide range with zeros, below the smallest scale (amax < MIN_SCALE * FP8_MAX), all zero."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 80, generator=g) * torch.logspace(-6, 4, 80)
    wide[::3] = 0.0
    return {
        "randn": torch.randn(37, 80, generator=g).to(dtype),
        "wide_with_zeros": wide.to(dtype),
        "tiny": (torch.randn(37, 80, generator=g) * 1e-36).to(dtype),
        "zeros": torch.zeros(37, 80, dtype=dtype),
    }


@pytest.mark.parametrize("fmt", [FP8Format.E4M3, FP8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traceable_quantizer_gives_the_eager_codes_and_scales(fmt, dtype):
    compiled = torch.compile(fp8_linear._quantize_traceable, fullgraph=True, dynamic=False)
    for name, x in _inputs(dtype).items():
        codes, scale = tensorwise.quantize_tensorwise(x, fmt)
        for how, fn in (("eager", fp8_linear._quantize_traceable), ("compiled", compiled)):
            c, s = fn(x, fmt)
            assert c.dtype == fmt.dtype and s.shape == (1,), (name, how)
            assert torch.equal(s, scale.reshape(1)), (name, how, s.item(), scale.item())
            same = c.view(torch.uint8) == codes.view(torch.uint8)
            assert same.all(), f"{name} {how}: {(~same).sum().item()} of {c.numel()} codes differ"


def test_float64_division_rounds_like_float32_division():
    """_quantize_traceable's divisions: float64 then one rounding to float32 equals the correctly
    rounded float32 quotient (what the eager twin and the Triton kernels compute)."""
    assert MIN_SCALE == torch.finfo(torch.float32).tiny  # the clamp _quantize_traceable spells out
    g = torch.Generator().manual_seed(4)
    amax = torch.exp2(torch.empty(200_000).uniform_(-130, 128, generator=g)) * (
        1 + torch.rand(200_000, generator=g)
    )
    amax = amax[torch.isfinite(amax) & (amax > 0)].float()
    for fmt in FP8Format:
        via64 = (amax.double() / fmt.max).float()
        assert torch.equal(via64, amax / torch.full_like(amax, fmt.max)), fmt
    scale = (amax / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    assert torch.equal((1.0 / scale.double()).float(), torch.ones_like(scale) / scale)


def _stack(backend: str, weight_grad: str = "fp8") -> nn.Sequential:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96, bias=False), nn.Linear(96, 48))
    return convert_to_fp8(
        model, config=FP8LinearConfig(backend=backend, weight_grad=weight_grad), min_features=None
    )


def _forward_backward(model: nn.Module, x: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.float().square().sum().backward()
    return [y, x.grad] + [p.grad for p in model.parameters()]


def _check_compiled_matches_eager(
    backend: str, autocast: bool, device: str, tokens: int = 37, compiled: nn.Module | None = None
) -> list[str]:
    """Compiled (fullgraph) vs eager FP8 stack: bit for bit but for the bias gradients (sums whose
    order inductor chooses). Returns inductor's generated code."""
    from torch._inductor.utils import run_and_get_code

    eager = _stack(backend).to(device)
    if compiled is None:
        compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, dynamic=False)
    compiled.zero_grad(set_to_none=True)  # a compiled module passed in may hold earlier gradients
    x = torch.randn(3, tokens, 64, device=device)
    with torch._inductor.config.patch(emulate_precision_casts=autocast):
        got, code = run_and_get_code(_forward_backward, compiled, x, autocast)
    want = _forward_backward(eager, x, autocast)
    names = ["out", "grad_input"] + [n for n, _ in eager.named_parameters()]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name.endswith("bias"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        else:
            diff = (a.float() - b.float()).abs().max().item()
            assert torch.equal(a, b), f"{name}: compiled differs from eager by up to {diff:.3g}"
    return code


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_stack_matches_eager_bit_for_bit(backend, autocast):
    """fullgraph=True: no graph break anywhere in the layer, forward or backward. M = 3 * 37 tokens
    is not a multiple of 16, so dW's padded operands are traced too. Under autocast with inductor's
    emulate_precision_casts, which keeps the bfloat16 round trips that eager makes (by default
    inductor drops them between fused ops, and the next layer quantizes unrounded values)."""
    _check_compiled_matches_eager(backend, autocast, "cpu")


def test_compiled_stack_with_high_precision_weight_grad():
    """weight_grad='high_precision' traces too (fullgraph); its dW is a plain matmul, whose
    summation order inductor may choose: equal to eager up to rounding."""
    eager = _stack(_BACKENDS[-1], "high_precision")
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, dynamic=False)
    x = torch.randn(3, 37, 64)
    for a, b in zip(_forward_backward(compiled, x, False), _forward_backward(eager, x, False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_stack_with_dynamic_shapes():
    """dynamic=True (what dynamo switches to when the batch changes): one graph for several token
    counts, padded (3 * 37, 3 * 45) or not (3 * 64), still the eager bits."""
    compiled = torch.compile(_stack(_BACKENDS[-1]), fullgraph=True, dynamic=True)
    for tokens in (37, 64, 45):
        _check_compiled_matches_eager(_BACKENDS[-1], False, "cpu", tokens, compiled)


def test_compiled_model_trains_with_compressed_adamw_under_compress_activations():
    """compress_activations entered OUTSIDE the compiled call compresses the compiled graph's saved
    bfloat16 tensors at run time; the losses track the same compiled training without it."""
    torch.manual_seed(6)
    base = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 16)
    )
    convert_to_fp8(
        base,
        filter_fn=lambda mod, name: name != "4",
        config=FP8LinearConfig(backend="emulate"),
        min_features=None,
    )
    data = [(torch.randn(64, 64), torch.randn(64, 16)) for _ in range(8)]
    losses, packed = {}, 0
    for compress in (False, True):
        model = torch.compile(copy.deepcopy(base), fullgraph=True, dynamic=False)
        opt = coatstate.CompressedAdamW(model.parameters(), lr=3e-3)
        losses[compress] = []
        for x, t in data:
            ctx = coatstate.compress_activations(min_numel=1024)
            with torch.autocast("cpu", dtype=torch.bfloat16), ctx if compress else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(x).float(), t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compress].append(loss.item())
            packed += ctx.stats.packed
    assert packed > 0, "compress_activations compressed none of the compiled graph's saved tensors"
    plain, comp = torch.tensor(losses[False]), torch.tensor(losses[True])
    assert torch.isfinite(comp).all() and comp[-1] < comp[0], losses
    rel = ((comp - plain).abs() / plain).max().item()
    assert rel < 0.05, f"compressing the compiled graph's saved tensors moved a loss by {rel:.2%}: {losses}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", [FP8Format.E4M3, FP8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_quantizer_matches_the_triton_kernel_on_gpu(fmt, dtype):
    """Inductor's Triton code (its float32 casts, our float64 divisions) against the eager CUDA
    quantizer (coatstate.kernels.tensorwise): the same codes and scales, so eager and compiled FP8Linear
    feed torch._scaled_mm the same operands."""
    from coatstate.kernels import tensorwise as tensorwise_kernels

    compiled = torch.compile(fp8_linear._quantize_traceable, fullgraph=True, dynamic=False)
    for name, x in _inputs(dtype).items():
        x = x.cuda()
        codes, scale = tensorwise_kernels.pack_tensorwise(x, fmt)
        c, s = compiled(x, fmt)
        assert torch.equal(s, scale[:1]), (name, s.item(), scale[0].item())
        same = c.view(torch.uint8) == codes.view(torch.uint8)
        assert same.all(), f"{name}: {(~same).sum().item()} of {c.numel()} codes differ"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_stack_matches_eager_with_scaled_mm_on_gpu(autocast):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs FP8 tensor cores (compute capability >= 8.9)")
    code = _check_compiled_matches_eager("auto", autocast, "cuda")
    assert "_scaled_mm" in "\n".join(code), "the compiled graphs do not call torch._scaled_mm"
