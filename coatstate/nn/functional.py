"""FP8Linear's math: per-tensor FP8 operands, the three FP8 GEMMs, the autograd Function.

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
come from coatstate.kernels.tensorwise's Triton pack kernel where FP8 casts exist (sm >= 8.9)
and from its pure-torch twin elsewhere; the two agree bit for bit.

Falls back to the plain high-precision nn.Linear forward, and says so (one log line, the module's
`fallback_reason`, `fp8_fallbacks(model)`), when: in_features or out_features is not a multiple
of 16 (torch._scaled_mm's constraint; decided at construction so CPU and GPU agree), the input
is not float32/bfloat16/float16, or the weight is a DTensor at forward time (tensor
parallelism). FSDP2: call convert_to_fp8 BEFORE fully_shard (it refuses DTensor parameters);
inside forward FSDP2 hands the layer the unsharded plain weight, so the FP8 path runs, the
gradient comes back in the weight's (FSDP param) dtype and is reduce-scattered as usual.

With compress_activations: the codes this layer saves are float8 tensors, which compress_activations
passes through untouched (KeepReason.NOT_FLOAT), so they are never compressed
twice; the weight is a parameter and is kept; the scales (one float32 each) are kept. The
weight's codes are re-derived in backward rather than saved: one more pass over the weight
instead of holding 1 byte per parameter of every layer until backward.

Under torch.compile (`torch.compile(model)`; fullgraph=True works on a stack of these layers)
the quantizer is `_quantize_traceable`, plain torch ops that inductor fuses with the amax, the
scale, the cast and the transposes around the GEMMs, instead of the Triton launcher; it gives
the same codes and scales (tests/nn/test_fp8_linear_compile.py). The shared-input cache is skipped
(a weak reference cannot be traced; fuse q/k/v into one layer instead), and which tensors
backward keeps is the partitioner's choice, not save_for_backward's. Inductor drops bfloat16
round trips between fused ops by default, so a compiled model quantizes slightly different
values than the eager one; with `torch._inductor.config.emulate_precision_casts = True` it
keeps them and compiled and eager agree bit for bit.
"""

from __future__ import annotations

import logging
import weakref

import torch

from coatstate.formats import tensorwise
from coatstate.formats.fp8 import FP8Format, round_to_fp8_grid
from coatstate.kernels.runtime import triton_usable

logger = logging.getLogger("coatstate")

ALIGN = 16  # torch._scaled_mm: K and N (and the inner dim of every GEMM) multiples of 16
_is_compiling = torch.compiler.is_compiling


# -- device capabilities ---------------------------------------------------------------------------
_CAPABILITY: dict[int, tuple[int, int]] = {}


def has_fp8_cores(device: torch.device) -> bool:
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
    if has_fp8_cores(t.device) and triton_usable(t.device):
        from coatstate.kernels import tensorwise as tensorwise_kernels

        codes, scale = tensorwise_kernels.pack_tensorwise(t.contiguous(), fmt)
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


class FP8LinearFunction(torch.autograd.Function):
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
                g_t = _transposed(g_q, ALIGN)  # (N, M padded)
                x_t = _transposed(x_q, ALIGN)  # (K, M padded): x_t.t() is column-major
                grad_w = _gemm(g_t, x_t.t(), s_g, s_x, weight.dtype, scaled_mm=scaled_mm, fast_accum=False)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None
