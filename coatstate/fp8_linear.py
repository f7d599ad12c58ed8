"""FP8Linear: an nn.Linear whose three GEMMs run in FP8 and whose saved input is FP8 (COAT's linear).

    model = coatstate.nn.convert_to_fp8(model, filter_fn=lambda mod, name: name != "head")

Forward (x: (..., K), weight: (N, K)):
    x_q, s_x = per-tensor E4M3 of x   (two-stage max: one max per 4096-element block, then the max
                                       of those; on device, no host sync)
    w_q, s_w = per-tensor E4M3 of the weight (re-derived from the master weight at every call)
    y = (x_q @ w_q^T) * s_x * s_w      torch._scaled_mm, fp32 accumulation, out in the compute dtype
Saved for backward: x_q (FP8, 1 byte/element) and s_x, plus the weight parameter itself (as
nn.Linear saves it: it is alive anyway). No high-precision copy of x is kept. Layers that take
the same input tensor in a row (separate q/k/v projections) share one x_q.
Backward (g: (..., N)):
    g_q, s_g = per-tensor FP8 of g (E5M2 by default, `grad_fmt`)
    dx = (g_q @ w_q) * s_g * s_w       w_q re-quantized from the weight (same codes as forward)
    dW = (g_q^T @ x_q) * s_g * s_x     in the weight's dtype (the optimizer's master precision);
                                       weight_grad="high_precision": g^T @ decode(x_q) in g's dtype

Operand layouts: torch._scaled_mm takes A row-major and B column-major. The forward needs no
copy (w_q^T of a row-major w_q is column-major); backward makes three FP8 transposes with
`.t().contiguous()` on uint8 views (1 byte/element, no Triton kernel): w_q for dx, g_q and x_q
for dW. The token count M is dW's inner dimension, so g_q^T and x_q^T are zero-padded to a
multiple of 16 when M is not (zeros add nothing to the sum).

Backends (`FP8LinearConfig.backend`): "scaled_mm" needs FP8 tensor cores (CUDA compute capability
>= 8.9); "emulate" runs the same quantized math with the GEMM in float32 on the dequantized codes
(exact products, only the summation order differs), on CPU and older GPUs; "auto" picks. Codes
come from coatstate.kernels.activation_pack's Triton pack kernel where FP8 casts exist (sm >= 8.9)
and from its pure-torch twin elsewhere; the two agree bit for bit.

Falls back to the plain high-precision nn.Linear forward, and says so (one log line, the module's
`fallback_reason`, `fp8_fallbacks(model)`), when: in_features or out_features is not a multiple
of 16 (torch._scaled_mm's constraint; decided at construction so CPU and GPU agree), the input
is not float32/bfloat16/float16, or the weight is a DTensor at forward time (tensor
parallelism). FSDP2: call convert_to_fp8 BEFORE fully_shard (it refuses DTensor parameters);
inside forward FSDP2 hands the layer the unsharded plain weight, so the FP8 path runs, the
gradient comes back in the weight's (FSDP param) dtype and is reduce-scattered as usual.

With compress_activations: the codes this layer saves are float8 tensors, which compress_activations
passes through untouched (its "not float16/bfloat16/float32" reason), so they are never compressed
twice; the weight is a parameter and is kept; the scales (one float32 each) are kept. The
weight's codes are re-derived in backward rather than saved: one more pass over the weight
instead of holding 1 byte per parameter of every layer until backward.

Under torch.compile (`torch.compile(model)`; fullgraph=True works on a stack of these layers)
the quantizer is `_quantize_traceable`, plain torch ops that inductor fuses with the amax, the
scale, the cast and the transposes around the GEMMs, instead of the Triton launcher; it gives
the same codes and scales (tests/test_fp8_linear_compile.py). The shared-input cache is skipped
(a weak reference cannot be traced; fuse q/k/v into one layer instead), and which tensors
backward keeps is the partitioner's choice, not save_for_backward's. Inductor drops bfloat16
round trips between fused ops by default, so a compiled model quantizes slightly different
values than the eager one; with `torch._inductor.config.emulate_precision_casts = True` it
keeps them and compiled and eager agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from coatstate.formats import tensorwise
from coatstate.formats.fp8 import FP8Format, round_to_fp8_grid

__all__ = ["FP8Linear", "FP8LinearConfig", "convert_to_fp8", "fp8_fallbacks"]

logger = logging.getLogger("coatstate")

_ALIGN = 16  # torch._scaled_mm: K and N (and the inner dim of every GEMM) multiples of 16
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BACKENDS = ("auto", "scaled_mm", "emulate")
_WEIGHT_GRADS = ("fp8", "high_precision")
_is_compiling = torch.compiler.is_compiling


@dataclasses.dataclass(frozen=True)
class FP8LinearConfig:
    """How FP8Linear computes. Strings are accepted for the format."""

    backend: str = "auto"
    """'auto' (scaled_mm on CUDA with compute capability >= 8.9, else emulate), 'scaled_mm', 'emulate'."""
    grad_fmt: FP8Format = FP8Format.E5M2
    """FP8 format of the output gradient. E4M3 has one more mantissa bit (gradient cosine 0.9993
    vs 0.9983 on Gaussian data; on a trained 512-wide byte-level GPT, fp8_linear_parity.py
    --grad-cosine, dx clears 0.999 with either once trained, dW reaches 0.973 with E5M2 and 0.9945
    with E4M3 at worst) but 2**15 less range, and range is what training needs: with the LM head
    in FP8 too E4M3 trained 4.3% above bf16 (E5M2 1.05%), and over three seeds with the head in
    bf16 (fp8_linear_parity.py --seeds) E5M2 stayed within 0.6% while E4M3 with a bf16 dW drifted
    up to 1.8%. E5M2 is the default, as in torchao and TransformerEngine."""
    fast_accum: bool = True
    """use_fast_accum for the forward GEMM (the backward GEMMs always accumulate exactly in fp32)."""
    weight_grad: str = "fp8"
    """'fp8': dW = g_q^T @ x_q in FP8 (COAT's, the fastest). 'high_precision': dW = g^T @ x' in the
    output gradient's dtype, g unquantized and x' the saved FP8 input decoded (as torchao's
    rowwise_with_gw_hp recipe): dW then keeps only x's E4M3 error (worst measured layer cosine
    0.9995 instead of 0.973) for 12% fewer tokens/s on the H200; over three seeds its final loss
    was no closer to bf16 than the default's (fp8_linear_parity.py --seeds)."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}; got {self.backend!r}")
        if self.weight_grad not in _WEIGHT_GRADS:
            raise ValueError(f"weight_grad must be one of {_WEIGHT_GRADS}; got {self.weight_grad!r}")
        object.__setattr__(self, "grad_fmt", FP8Format.parse(self.grad_fmt))
        if not isinstance(self.fast_accum, bool):
            raise TypeError(f"fast_accum must be a bool; got {self.fast_accum!r}")


# -- device capabilities ---------------------------------------------------------------------------
_CAPABILITY: dict[int, tuple[int, int]] = {}


def _has_fp8_cores(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    if _is_compiling():  # no cache or log line inside a trace: dynamo folds the capability to a constant
        return torch.cuda.get_device_capability(device) >= (8, 9)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
        if _CAPABILITY[index] < (8, 9):
            logger.info(
                "FP8Linear: cuda:%d (sm_%d%d) has no FP8 tensor cores; emulating the FP8 GEMMs in fp32",
                index,
                *_CAPABILITY[index],
            )
    return _CAPABILITY[index] >= (8, 9)


# -- quantize, transpose, GEMM ----------------------------------------------------------------------
def _quantize(t: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in t's shape, float32 scale of one element) by the per-tensor two-stage max."""
    if _is_compiling():
        return _quantize_traceable(t, fmt)
    if _has_fp8_cores(t.device):
        from coatstate.kernels import activation_pack

        codes, scale = activation_pack.pack_tensorwise(t.contiguous(), fmt)
        return codes, scale[:1]  # pack returns [scale, 1/scale]
    codes, scale = tensorwise.quantize_tensorwise(t, fmt)
    return codes, scale.reshape(1)


def _quantize_traceable(t: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize in plain torch ops that inductor fuses around the GEMMs: the same codes and scale.

    amax: one reduction (a maximum is exact, so any order gives the two-stage max). The two
    divisions run in float64 and round once to float32: for float32 operands that is the correctly
    rounded float32 quotient (53 >= 2 * 24 + 2 bits, so the double rounding is innocuous), which
    inductor's Triton code would not give for a float32 `/` (it lowers to an approximate division).
    """
    amax = t.abs().amax().float()
    # the format's maximum as a literal, not fmt.max: on torch 2.11 dynamo failed with
    # "lift_tracked_freevar_to_input should not be called on root SubgraphTracer" when backward
    # quantized with the format the forward had used (E4M3 gradients)
    fp8_max = 448.0 if fmt is FP8Format.E4M3 else 57344.0
    # MIN_SCALE (2**-126) spelled through finfo: under dynamic shapes dynamo makes a module-level
    # float a symbolic input, which it then fails to lift into the autograd.Function's graph
    scale = (amax.double() / fp8_max).float().clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.where(amax > 0, scale, 0.0)
    inv = torch.where(scale > 0, (1.0 / scale.double()).float(), 0.0)
    codes = round_to_fp8_grid(t.float() * inv, fmt).to(fmt.dtype)
    return codes, scale.reshape(1)


def _transposed(codes: torch.Tensor, pad_cols_to: int = 1) -> torch.Tensor:
    """codes^T as a contiguous tensor, its columns zero-padded up to a multiple of `pad_cols_to`.

    Done on a uint8 view: a plain byte copy, whatever the FP8 dtype.
    """
    rows, cols = codes.shape
    padded = -(-rows // pad_cols_to) * pad_cols_to
    raw = codes.view(torch.uint8)
    if padded == rows:
        return raw.t().contiguous().view(codes.dtype)
    out = torch.zeros(cols, padded, dtype=torch.uint8, device=codes.device)
    out[:, :rows].copy_(raw.t())
    return out.view(codes.dtype)


def _gemm(a, b, scale_a, scale_b, out_dtype, *, scaled_mm: bool, fast_accum: bool) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b in out_dtype; a row-major, b column-major (FP8 codes)."""
    if scaled_mm:
        # what cuBLASLt requires; checked here on CPU too (eagerly: under torch.compile inductor
        # lays out the operands, and a raise in the traced backward upsets dynamo's autocast restore)
        if not _is_compiling() and (a.stride(1) != 1 or b.stride(0) != 1):
            raise RuntimeError(
                f"internal error: _scaled_mm needs row-major A and column-major B; got strides "
                f"{a.stride()} and {b.stride()}"
            )
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    # Emulation: products of FP8 values are exact in fp32; only the summation order differs.
    return (torch.mm(a.float(), b.float()) * (scale_a * scale_b)).to(out_dtype)


class _LastInput:
    """The last input quantized and its codes: layers fed the same tensor one after the other
    (separate q/k/v or gate/up projections) then quantize it once and save ONE FP8 copy, where
    each would otherwise save its own. Valid only while that very tensor object is alive and
    unmodified (weak reference + version counter); dropped when it dies."""

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.version = -1
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.ref is not None and self.ref() is x and x._version == self.version:
            return self.value
        return None

    def put(self, x: torch.Tensor, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.ref, self.version, self.value = weakref.ref(x, self._drop), x._version, value

    def _drop(self, ref: weakref.ref) -> None:
        if ref is self.ref:
            self.ref = self.value = None


_last_input = _LastInput()


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, scaled_mm, cfg):
        k = x.shape[-1]
        # no cache under torch.compile (a weak reference cannot be traced) nor for inference
        # tensors (they have no version counter)
        use_cache = not _is_compiling() and not x.is_inference()
        cached = _last_input.get(x) if use_cache else None
        if cached is None:
            cached = _quantize(x.reshape(-1, k), FP8Format.E4M3)
            if use_cache:
                _last_input.put(x, cached)
        x_q, s_x = cached
        w_q, s_w = _quantize(weight.detach(), FP8Format.E4M3)
        out = _gemm(x_q, w_q.t(), s_x, s_w, out_dtype, scaled_mm=scaled_mm, fast_accum=cfg.fast_accum)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(x_q, s_x, weight)
        ctx.x_shape, ctx.x_dtype, ctx.scaled_mm, ctx.cfg = x.shape, x.dtype, scaled_mm, cfg
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_q, s_x, weight = ctx.saved_tensors
        cfg, scaled_mm = ctx.cfg, ctx.scaled_mm
        with torch.autocast(grad_out.device.type, enabled=False):
            g = grad_out.reshape(-1, grad_out.shape[-1])
            hp_weight_grad = cfg.weight_grad == "high_precision"
            if ctx.needs_input_grad[0] or not hp_weight_grad:
                g_q, s_g = _quantize(g, cfg.grad_fmt)
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                w_q, s_w = _quantize(weight.detach(), FP8Format.E4M3)
                w_t = _transposed(w_q)  # (K, N) row-major: w_t.t() is w_q column-major
                grad_x = _gemm(g_q, w_t.t(), s_g, s_w, ctx.x_dtype, scaled_mm=scaled_mm, fast_accum=False)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1] and hp_weight_grad:
                x_hp = (x_q.float() * s_x).to(g.dtype)  # the saved input decoded
                grad_w = (g.t() @ x_hp).to(weight.dtype)
            elif ctx.needs_input_grad[1]:
                g_t = _transposed(g_q, _ALIGN)  # (N, M padded)
                x_t = _transposed(x_q, _ALIGN)  # (K, M padded): x_t.t() is column-major
                grad_w = _gemm(g_t, x_t.t(), s_g, s_x, weight.dtype, scaled_mm=scaled_mm, fast_accum=False)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


# -- the module -------------------------------------------------------------------------------------
def _shape_problem(in_features: int, out_features: int) -> str | None:
    if in_features % _ALIGN or out_features % _ALIGN:
        return (
            f"in_features={in_features} and out_features={out_features} must both be multiples of "
            f"{_ALIGN} for torch._scaled_mm"
        )
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


class FP8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs and an FP8 saved input (see the module docstring).

    Same parameters, buffers and state-dict keys as nn.Linear, so checkpoints load into either.
    Master weights stay in whatever dtype the parameter has (the optimizer's precision); only
    the GEMM operands are FP8. `fallback_reason` is None while the FP8 path runs, else why not.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        config: FP8LinearConfig | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(config, log=True)

    def _setup_fp8(self, config: FP8LinearConfig | None, log: bool) -> None:
        config = config if config is not None else FP8LinearConfig()
        if not isinstance(config, FP8LinearConfig):
            raise TypeError(f"config must be an FP8LinearConfig; got {type(config).__name__}")
        self.fp8_config = config
        self.fallback_reason = _shape_problem(self.in_features, self.out_features)
        if log and self.fallback_reason:
            logger.warning("FP8Linear runs in high precision: %s", self.fallback_reason)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: FP8LinearConfig | None = None) -> FP8Linear:
        """Turn `linear` itself into an FP8Linear (in place: same object, parameters and hooks)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"from_linear takes an nn.Linear (exactly); got {type(linear).__name__}")
        linear.__class__ = cls
        linear._setup_fp8(config, log=True)
        return linear

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        logger.warning(
            "FP8Linear(%d -> %d) runs in high precision: %s", self.in_features, self.out_features, reason
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback_reason is None:
            if x.dtype not in _FLOAT_DTYPES:
                self._fall_back(f"input dtype {x.dtype} (FP8 path takes float32, bfloat16, float16)")
            elif _is_dtensor(self.weight):
                self._fall_back("the weight is a DTensor at forward time (tensor parallelism)")
        if self.fallback_reason is not None:
            return F.linear(x, self.weight, self.bias)
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        backend = self.fp8_config.backend
        scaled_mm = backend == "scaled_mm" or (backend == "auto" and _has_fp8_cores(x.device))
        with torch.autocast(device, enabled=False):
            return _FP8LinearFunction.apply(x, self.weight, self.bias, out_dtype, scaled_mm, self.fp8_config)

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        fp8 = f"backend={cfg.backend}, grad_fmt={cfg.grad_fmt.value}, fast_accum={cfg.fast_accum}"
        if self.fallback_reason:
            fp8 += f", HIGH PRECISION ({self.fallback_reason})"
        return f"{super().extra_repr()}, {fp8}"


def convert_to_fp8(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    config: FP8LinearConfig | None = None,
) -> nn.Module:
    """Turn the nn.Linear modules of `model` (those `filter_fn(module, name)` accepts) into FP8Linear.

    In place, and returns `model`. Each module keeps its identity, parameters (tied weights stay
    tied, an optimizer built before keeps working), hooks and state-dict keys, so a checkpoint of
    the converted model loads into the original and back. Only modules of type exactly nn.Linear
    are converted (subclasses such as MultiheadAttention's out_proj never run their own forward).
    Layers whose shape torch._scaled_mm cannot take are converted but run in high precision;
    one log line lists them, and so does `fp8_fallbacks(model)`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable as filter_fn(module, name) -> bool; got {filter_fn!r}")
    sharded = [name for name, p in model.named_parameters() if _is_dtensor(p)]
    if sharded:  # FSDP2 wraps modules in subclasses a type check would skip: refuse, never skip silently
        raise ValueError(
            f"{len(sharded)} parameters (e.g. {sharded[0]!r}) are already DTensors: call convert_to_fp8 "
            "BEFORE fully_shard (FSDP2) or parallelize_module"
        )
    converted = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or (filter_fn is not None and not filter_fn(module, name)):
            continue
        module.__class__ = FP8Linear
        module._setup_fp8(config, log=False)
        converted.append(name)
    fallbacks = fp8_fallbacks(model)
    if fallbacks:
        logger.warning(
            "convert_to_fp8: %d of %d converted linear layers run in high precision: %s",
            len(fallbacks),
            len(converted),
            "; ".join(f"{n} ({r})" for n, r in fallbacks.items()),
        )
    return model


def fp8_fallbacks(model: nn.Module) -> dict[str, str]:
    """{module name: reason} for every FP8Linear in `model` that runs in high precision."""
    return {
        name: module.fallback_reason
        for name, module in model.named_modules()
        if isinstance(module, FP8Linear) and module.fallback_reason is not None
    }
