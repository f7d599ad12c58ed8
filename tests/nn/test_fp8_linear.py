"""FP8Linear / convert_to_fp8: gradient fidelity against nn.Linear, state-dict compatibility,
fallback reporting, saved tensors, compress_activations and CompressedAdamW together, and (GPU)
torch._scaled_mm against the fp32 emulation."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coatstate
from coatstate.nn import FP8Linear, FP8LinearConfig, convert_to_fp8, fp8_fallbacks
from tests.conftest import requires_cuda


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _pair(k: int, n: int, bias: bool = True, **cfg) -> tuple[nn.Linear, FP8Linear]:
    ref = nn.Linear(k, n, bias=bias)  # nn.Linear's own init: kaiming-uniform weight
    fp8 = FP8Linear.from_linear(copy.deepcopy(ref), FP8LinearConfig(**cfg))
    return ref, fp8


def _run(layer: nn.Module, x: torch.Tensor, gy: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(gy)
    lin = layer[0] if isinstance(layer, nn.Sequential) else layer
    return y, x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad


# -- gradient fidelity ---------------------------------------------------------------------------
# One FP8 rounding has a relative RMS error of about 2**-m / sqrt(12) * 1.2 for m mantissa bits on
# Gaussian data: 2.5% for E4M3, 4.9% for E5M2. A GEMM of many independent terms keeps that
# relative error, so the cosine of the gradients is about 1 - err**2 / 2: E5M2 output gradients
# (the default, as torchao's and TransformerEngine's) give ~0.9983 and cannot reach 0.999; E4M3
# ones give ~0.9993. E4M3's narrower range costs where gradients span many binades (an FP8 LM
# head trained 4.3% above bf16 with E4M3, 1.05% with E5M2: benchmarks/experiments/fp8_linear_parity.py), so
# E5M2 stays the default. Both are asserted, at bounds a little below what they measure, and
# printed (`pytest -s`).
@pytest.mark.parametrize("grad_fmt, bound", [("e4m3", 0.999), ("e5m2", 0.998)])
@pytest.mark.parametrize("k, n", [(512, 2048), (2048, 512)])
def test_gradient_fidelity_against_nn_linear(grad_fmt, bound, k, n):
    torch.manual_seed(1)
    ref, fp8 = _pair(k, n, grad_fmt=grad_fmt, backend="emulate")
    x = torch.randn(4, 512, k)
    gy = torch.randn(4, 512, n)
    y0, dx0, dw0, db0 = _run(ref, x, gy)
    y1, dx1, dw1, db1 = _run(fp8, x, gy)
    cos = {"out": _cos(y1, y0), "grad_input": _cos(dx1, dx0), "grad_weight": _cos(dw1, dw0)}
    print(f"\nK={k} N={n} grad {grad_fmt}: " + ", ".join(f"cos({n_})={c:.5f}" for n_, c in cos.items()))
    assert cos["out"] >= 0.999, cos  # forward: E4M3 input and weight
    assert cos["grad_input"] >= bound and cos["grad_weight"] >= bound, cos
    torch.testing.assert_close(db1, db0, rtol=1e-5, atol=1e-5)  # bias grad: high-precision sum
    assert dw1.dtype == torch.float32 and dx1.dtype == torch.float32


@functools.lru_cache(maxsize=1)
def _real_linear_io(steps: int = 10):
    """(layer, its input, its output gradient) of every linear of a small byte-level GPT after a
    few AdamW steps on the standard library's source: gradients with a real network's structure."""
    from train_gpt import batches, stdlib_corpus

    from coatstate.models import GPT, ModelConfig

    torch.manual_seed(5)
    model = GPT(ModelConfig(vocab=256, layers=2, dim=128, heads=2, seq=128))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    stream = batches(stdlib_corpus(2**20), 8, 128, 0)
    for _ in range(steps):
        loss = model(*next(stream))
        opt.zero_grad()
        loss.backward()
        opt.step()
    seen = {}
    layers = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n != "head"}
    for name, mod in layers.items():
        mod.register_forward_hook(lambda m, i, o, n=name: seen.__setitem__(n, [i[0].detach()]))
        mod.register_full_backward_hook(lambda m, gi, go, n=name: seen[n].append(go[0].detach()))
    model(*next(stream)).backward()
    return [(layers[n], x, g) for n, (x, g) in seen.items()]


@pytest.mark.parametrize(
    "grad_fmt, weight_grad, bound",
    [("e4m3", "fp8", 0.999), ("e5m2", "fp8", 0.998), ("e4m3", "high_precision", 0.999)],
)
def test_gradient_fidelity_on_real_gpt_gradients(grad_fmt, weight_grad, bound):
    worst = {"grad_input": 1.0, "grad_weight": 1.0}
    for layer, x, g in _real_linear_io():
        ref = nn.Linear(layer.in_features, layer.out_features)
        ref.load_state_dict(layer.state_dict())
        cfg = FP8LinearConfig(grad_fmt=grad_fmt, weight_grad=weight_grad, backend="emulate")
        fp8 = FP8Linear.from_linear(copy.deepcopy(ref), cfg)
        _, dx0, dw0, _ = _run(ref, x, g)
        _, dx1, dw1, _ = _run(fp8, x, g)
        worst["grad_input"] = min(worst["grad_input"], _cos(dx1, dx0))
        worst["grad_weight"] = min(worst["grad_weight"], _cos(dw1, dw0))
    print(
        f"\nreal GPT gradients, grad {grad_fmt}, weight grad {weight_grad}: worst layer "
        + ", ".join(f"cos({k})={v:.5f}" for k, v in worst.items())
    )
    assert min(worst.values()) >= bound, worst


def test_autocast_dtypes_and_master_weights_stay_fp32():
    ref, fp8 = _pair(256, 128)
    x = torch.randn(64, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
        y_ref = ref(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    y.float().pow(2).mean().backward()
    assert fp8.weight.dtype == fp8.weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    assert _cos(y.float(), y_ref.float()) >= 0.999


def test_zero_input_and_no_bias():
    _, fp8 = _pair(32, 48, bias=False)
    x = torch.zeros(5, 32, requires_grad=True)
    y = fp8(x)
    y.sum().backward()
    assert torch.equal(y, torch.zeros(5, 48)) and torch.equal(fp8.weight.grad, torch.zeros(48, 32))
    assert torch.isfinite(x.grad).all()


# -- what is saved for backward ------------------------------------------------------------------
def test_saves_fp8_input_not_a_high_precision_copy():
    _, fp8 = _pair(128, 64)
    x = torch.randn(8, 16, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8(x)
    dtypes = sorted(str(t.dtype) for t in saved)
    assert dtypes == ["torch.float32", "torch.float32", "torch.float8_e4m3fn"], dtypes
    codes = next(t for t in saved if t.dtype == torch.float8_e4m3fn)
    assert codes.numel() == x.numel()
    assert any(t is fp8.weight for t in saved)  # the parameter itself, as nn.Linear saves it
    scale = next(t for t in saved if t.dtype == torch.float32 and t is not fp8.weight)
    assert scale.numel() == 1


def test_layers_fed_the_same_input_share_one_fp8_copy():
    torch.manual_seed(7)
    q, k = (FP8Linear(64, 32) for _ in range(2))
    x = torch.randn(10, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = q(x) + k(x)
        x2 = x * 1.0  # a different tensor: quantized on its own
        y = y + q(x2)
    codes = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert len(codes) == 3 and codes[0] is codes[1] and codes[2] is not codes[0]
    y.sum().backward()
    with torch.no_grad():
        q(x)  # x's codes are now the last ones quantized
        x.mul_(2.0)  # an in-place change (version bump) must not reuse them
        assert torch.equal(k(x), k(x.clone()))
    with torch.inference_mode():  # no version counter there: no sharing, still runs
        assert q(torch.randn(4, 64)).shape == (4, 32)


def test_compress_activations_never_compresses_the_fp8_codes_again():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 96), nn.Linear(96, 32))
    convert_to_fp8(model, min_features=None)
    x = torch.randn(4, 40, 64)
    w = torch.randn(4, 40, 32)  # a loss whose own saved tensor (w) is not an activation

    def grads(ctx=None):
        model.zero_grad(set_to_none=True)
        if ctx is None:
            (model(x) * w).sum().backward()
        else:
            with ctx:
                loss = (model(x) * w).sum()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    ctx = coatstate.compress_activations(min_numel=0)
    packed = grads(ctx)
    assert ctx.stats.packed == 0, ctx.stats.summary()  # nothing re-quantized
    assert ctx.stats.kept_reasons["not float16/bfloat16/float32"] == 3, ctx.stats.summary()
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)


# -- conversion, checkpoints, fallbacks ----------------------------------------------------------
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mha = nn.MultiheadAttention(32, 2, batch_first=True)
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h) + self.odd(F.relu(self.up(h)))[..., :1]


def test_state_dict_keys_round_trip_with_the_original_model(tmp_path):
    original = _Tiny()
    converted = convert_to_fp8(
        copy.deepcopy(original), filter_fn=lambda mod, name: name != "head", min_features=None
    )
    assert type(converted.up) is FP8Linear and type(converted.head) is nn.Linear
    assert type(converted.mha.out_proj) is not FP8Linear  # MHA never calls out_proj.forward
    assert converted.head.weight is converted.emb.weight  # ties survive
    assert list(converted.state_dict()) == list(original.state_dict())
    torch.save(converted.state_dict(), tmp_path / "fp8.pt")
    fresh = _Tiny()
    fresh.load_state_dict(torch.load(tmp_path / "fp8.pt", weights_only=True), strict=True)
    for a, b in zip(fresh.state_dict().values(), original.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    back = convert_to_fp8(_Tiny(), min_features=None)
    back.load_state_dict(original.state_dict(), strict=True)
    idx = torch.randint(0, 64, (2, 16))
    assert _cos(back(idx), original(idx)) >= 0.999


def test_fallback_is_reported_and_runs_high_precision(caplog):
    model = _Tiny()
    with caplog.at_level(logging.WARNING, logger="coatstate"):
        convert_to_fp8(model, min_features=None)
    lines = [r.getMessage() for r in caplog.records if "high precision" in r.getMessage()]
    assert len(lines) == 1 and "odd" in lines[0] and "out_features=40" in lines[0], lines
    assert list(fp8_fallbacks(model)) == ["odd"]
    assert "HIGH PRECISION" in repr(model.odd)
    x = torch.randn(3, 64)
    assert torch.equal(model.odd(x), F.linear(x, model.odd.weight, model.odd.bias))
    assert model.up.fallback_reason is None


def test_runtime_fallback_for_float64_is_reported_once(caplog):
    ref, fp8 = _pair(32, 32)
    x = torch.randn(4, 32, dtype=torch.float64)
    fp8.double(), ref.double()
    with caplog.at_level(logging.WARNING, logger="coatstate"):
        y = fp8(x)
        fp8(x)
    assert torch.equal(y, ref(x))
    assert sum("float64" in r.getMessage() for r in caplog.records) == 1
    assert "float64" in fp8.fallback_reason


def test_high_precision_weight_grad_decodes_the_saved_fp8_input():
    """weight_grad='high_precision': dW = g^T @ decode(x_q) exactly (no FP8 on g), dx unchanged."""
    torch.manual_seed(3)
    _, fp8 = _pair(256, 128, backend="emulate")
    _, hp = _pair(256, 128, backend="emulate", weight_grad="high_precision")
    hp.load_state_dict(fp8.state_dict())
    x, gy = torch.randn(64, 256), torch.randn(64, 128)
    _, dx1, dw1, _ = _run(fp8, x, gy)
    _, dx2, dw2, _ = _run(hp, x, gy)
    from coatstate.formats import tensorwise

    codes, scale = tensorwise.quantize_tensorwise(x, "e4m3")
    torch.testing.assert_close(dw2, gy.t() @ (codes.float() * scale), rtol=1e-5, atol=1e-5)
    assert torch.equal(dx1, dx2)
    assert _cos(dw2, gy.t() @ x) > _cos(dw1, gy.t() @ x)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="backend"):
        FP8LinearConfig(backend="cublas")
    with pytest.raises(ValueError, match="FP8 format"):
        FP8LinearConfig(grad_fmt="e3m4")
    with pytest.raises(ValueError, match="weight_grad"):
        FP8LinearConfig(weight_grad="bf16")
    with pytest.raises(TypeError, match="filter_fn"):
        convert_to_fp8(nn.Linear(16, 16), filter_fn="head")
    with pytest.raises(TypeError, match="nn.Linear"):
        FP8Linear.from_linear(nn.Conv1d(16, 16, 1))
    with pytest.raises(TypeError, match="FP8LinearConfig"):
        FP8Linear(16, 16, config={"backend": "emulate"})


def test_trains_with_compressed_adamw_and_compress_activations():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    convert_to_fp8(model, min_features=None)
    opt = coatstate.CompressedAdamW(model.parameters(), lr=3e-3, min_numel=0)
    target = torch.randn(64, 64) / 8
    x = torch.randn(256, 64)
    losses = []
    for _ in range(30):
        with coatstate.compress_activations(min_numel=0):
            loss = (model(x) - x @ target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses[::10]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert opt.state[model[0].weight]["exp_avg_codes"].dtype == torch.float8_e4m3fn  # FP8 moments


def test_fsdp2_shards_the_master_weight_and_keeps_the_fp8_path(tmp_path):
    """One-process gloo FSDP2 on CPU: between steps the weight is a DTensor shard, inside forward
    the unsharded plain tensor, so the FP8 path runs and the gradients equal the unsharded layer's."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = convert_to_fp8(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), min_features=None
        )
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="BEFORE fully_shard"):
            convert_to_fp8(model, min_features=None)
        x = torch.randn(32, 64)
        model(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert type(p).__name__ == "DTensor"
            assert torch.equal(p.grad.full_tensor(), q.grad)
        assert fp8_fallbacks(model) == {} and isinstance(model[0], FP8Linear)
    finally:
        dist.destroy_process_group()


# -- the torch._scaled_mm path against the emulation ----------------------------------------------
def _scaled_mm_runs_on(device: str) -> bool:
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _compare_backends(
    device: str, dtype: torch.dtype, m: int, k: int, n: int, tol: dict, weight_grad: str = "fp8"
) -> None:
    torch.manual_seed(4)
    base = nn.Linear(k, n).to(device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    gy = torch.randn(m, n, device=device, dtype=dtype)
    outs = {}
    for backend in ("scaled_mm", "emulate"):
        cfg = FP8LinearConfig(backend=backend, weight_grad=weight_grad)
        layer = FP8Linear.from_linear(copy.deepcopy(base), cfg)
        outs[backend] = _run(layer.to(dtype) if dtype != torch.float32 else layer, x, gy)
    for name, a, b in zip(("out", "grad_input", "grad_weight", "grad_bias"), *outs.values(), strict=True):
        err = _rel(a, b)
        print(f"{device} {dtype} M={m}: {name} scaled_mm vs emulate rel. error {err:.2e}")
        assert a.dtype == b.dtype and a.shape == b.shape
        assert err <= tol[name], (name, err)


def test_scaled_mm_path_layouts_on_cpu():
    """torch 2.13's CPU _scaled_mm runs the real code path (operand layouts, M padding) here."""
    if not _scaled_mm_runs_on("cpu"):
        pytest.skip(f"torch {torch.__version__} has no CPU torch._scaled_mm")
    tol = dict(out=1e-6, grad_input=1e-6, grad_weight=1e-6, grad_bias=1e-6)
    _compare_backends("cpu", torch.float32, 37, 64, 48, tol)  # M = 37: dW's inner dim padded


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [4096, 1000])
@pytest.mark.parametrize("weight_grad", ["fp8", "high_precision"])
def test_scaled_mm_matches_emulation_on_gpu(dtype, m, weight_grad):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs FP8 tensor cores (compute capability >= 8.9)")
    # Same codes on both paths (Triton pack kernel); the GEMMs differ in summation order and, in
    # the forward, in use_fast_accum (tensor-core FP8 accumulation); bf16 outputs round at 2**-9.
    # fp32 backward: measured on the H200 9.6e-5 for grad_input (K = 2048; the run stopped there,
    # grad_weight unmeasured): Hopper's FP8 tensor cores keep ~14 mantissa bits between cuBLAS's
    # fp32 promotions, so the same 2e-4 bound covers the other backward GEMM.
    fwd = 1e-2 if dtype == torch.float32 else 1.2e-2
    bwd = 2e-4 if dtype == torch.float32 else 4e-3
    tol = dict(out=fwd, grad_input=bwd, grad_weight=bwd, grad_bias=bwd)
    _compare_backends("cuda", dtype, m, 1024, 2048, tol, weight_grad)


@pytest.mark.gpu
@requires_cuda
def test_auto_backend_uses_scaled_mm_on_fp8_gpus():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    layer = convert_to_fp8(nn.Sequential(nn.Linear(256, 256)), min_features=None).cuda()
    calls = []
    real = torch._scaled_mm
    try:
        torch._scaled_mm = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(torch.randn(64, 256, device="cuda", requires_grad=True))
        y.float().sum().backward()
    finally:
        torch._scaled_mm = real
    assert len(calls) == 3  # forward, grad_input, grad_weight


@pytest.mark.gpu
@requires_cuda
def test_matches_torchao_float8_tensorwise_on_gpu():
    """torchao's Float8Linear (tensorwise: E4M3 input and weight, E5M2 output gradient) does the
    same math; on CPU with torch 2.13 the two agreed to 2e-7 relative (not a CI test: torchao is
    not a dependency)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(6)
    base = nn.Sequential(nn.Linear(1024, 2048)).cuda()
    ours = convert_to_fp8(copy.deepcopy(base), config=FP8LinearConfig(grad_fmt="e5m2"), min_features=None)
    theirs = float8.convert_to_float8_training(copy.deepcopy(base))
    x = torch.randn(4096, 1024, device="cuda")
    gy = torch.randn(4096, 2048, device="cuda")
    (y0, dx0, dw0, _), (y1, dx1, dw1, _) = _run(theirs, x, gy), _run(ours, x, gy)
    for name, a, b in (("out", y1, y0), ("grad_input", dx1, dx0), ("grad_weight", dw1, dw0)):
        print(f"coatstate vs torchao {name}: rel. error {_rel(a, b):.2e}")
        assert _rel(a, b) <= 2e-3, name  # same codes; scale rounding and GEMM kernels may differ


def test_triton_pack_path_gives_the_twins_codes(monkeypatch):
    """The GPU quantizer (kernels.tensorwise under Triton's interpreter here) and the CPU twin
    give the same codes and scales, so the layer's results are identical bit for bit."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # TRITON_INTERPRET is only set without CUDA (conftest.py)
        pytest.skip("runs the kernel on CPU tensors under Triton's interpreter; the gpu tests cover CUDA")
    import coatstate.nn.functional as mod

    torch.manual_seed(8)
    base = nn.Linear(32, 48)
    x = torch.randn(3, 20, 32)
    gy = torch.randn(3, 20, 48)
    twin = _run(FP8Linear.from_linear(copy.deepcopy(base), FP8LinearConfig(backend="emulate")), x, gy)
    monkeypatch.setattr(mod, "has_fp8_cores", lambda device: True)
    kernel = _run(FP8Linear.from_linear(copy.deepcopy(base), FP8LinearConfig(backend="emulate")), x, gy)
    for a, b in zip(kernel, twin, strict=True):
        assert torch.equal(a, b)


def test_min_features_keeps_narrow_layers_and_says_so(caplog):
    """Layers with fewer in or out features than min_features stay nn.Linear, listed in one log
    line; the others convert; a bad value is refused before anything changes."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 16))
    with pytest.raises(ValueError, match="min_features must be a positive int"):
        convert_to_fp8(model, min_features=0)
    assert type(model[0]) is nn.Linear
    with caplog.at_level(logging.INFO, logger="coatstate"):
        convert_to_fp8(model, min_features=32)
    assert isinstance(model[0], FP8Linear) and type(model[2]) is nn.Linear
    assert "kept 1 linear layers narrower than min_features=32" in caplog.text and "2 (256x16)" in caplog.text


def test_by_default_layers_narrower_than_fp8s_measured_crossover_stay_high_precision(caplog):
    """The default min_features (the width from which FP8 paid on an H200) keeps a 1024-wide layer
    and converts a 1536-wide one; the log line names the way to convert every width."""
    from coatstate.nn.convert import DEFAULT_MIN_FEATURES

    assert DEFAULT_MIN_FEATURES == 1536
    model = nn.Sequential(nn.Linear(1024, 1536, bias=False), nn.Linear(1536, 1536, bias=False))
    with caplog.at_level(logging.INFO, logger="coatstate"):
        convert_to_fp8(model)
    assert type(model[0]) is nn.Linear and isinstance(model[1], FP8Linear)
    assert "0 (1024x1536)" in caplog.text and "min_features=None converts them" in caplog.text
