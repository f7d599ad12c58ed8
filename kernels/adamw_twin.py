"""The pure-torch AdamW step over FP8 group-compressed moments: the CPU path and the oracle of
the fused Triton step (kernels/adamw_fused.py).

The update is torch.optim.AdamW's single-tensor update, op for op and in its order, in float32:
  p *= 1 - lr*wd;  m.lerp_(g, 1-b1);  v = v*b2 + (1-b2)*g*g;
  denom = sqrt(v) / sqrt(1 - b2**t) + eps;  p -= (lr / (1 - b1**t)) * m / denom
with the bias corrections and step size computed from Python floats (float64), as torch does.
A moment that is compressed is dequantized before and requantized after; one that is not is
updated in place, so with nothing compressed the result equals torch.optim.AdamW bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import FP8Format, dequantize_groups, group_layout, quantize_groups

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How one optimizer moment is stored."""

    fmt: FP8Format = FP8Format.E4M3
    """FP8 format of the codes."""
    expand: bool = True
    """Dynamic range expansion (COAT sec. 4) on or off."""
    group_size: int = 128
    """Elements per group along a row."""


def state_keys(name: str, moment_format: MomentFormat | None) -> tuple[str, ...]:
    """The state-dict keys that hold moment `name` in `moment_format` (None: one fp32 tensor)."""
    if moment_format is None:
        return (name,)
    keys = (f"{name}_codes", f"{name}_scales")
    return keys + ((f"{name}_exponents",) if moment_format.expand else ())


def is_compressed(state: dict, name: str) -> bool:
    return f"{name}_codes" in state


def init_moment(state: dict, name: str, like: torch.Tensor, moment_format: MomentFormat | None) -> None:
    """Zero moment `name` for a parameter shaped like `like` (its local shard for a DTensor)."""
    if moment_format is None:
        state[name] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        return
    rows, _, groups = group_layout(like.shape, moment_format.group_size)
    state[f"{name}_codes"] = torch.zeros(like.shape, dtype=moment_format.fmt.dtype, device=like.device)
    state[f"{name}_scales"] = torch.zeros((rows, groups), dtype=torch.float32, device=like.device)
    if moment_format.expand:
        # what quantize() gives for an all-zero group: k = 1
        state[f"{name}_exponents"] = torch.full((rows, groups), 16, dtype=torch.uint8, device=like.device)


def read_moment(state: dict, name: str, group_size: int) -> torch.Tensor:
    """Moment `name` as float32 in the parameter's shape (a view for an uncompressed moment)."""
    if not is_compressed(state, name):
        return state[name]
    codes = state[f"{name}_codes"]
    rows, cols, _ = group_layout(codes.shape, group_size)
    x = dequantize_groups(
        codes.reshape(rows, cols), state[f"{name}_scales"], state.get(f"{name}_exponents"), group_size
    )
    return x.reshape(codes.shape)


def write_moment(state: dict, name: str, value: torch.Tensor, moment_format: MomentFormat | None) -> None:
    """Store float32 `value` into moment `name`, in place (requantized when compressed)."""
    if moment_format is None:
        if state[name] is not value:
            state[name].copy_(value)
        return
    codes = state[f"{name}_codes"]
    rows, cols, _ = group_layout(codes.shape, moment_format.group_size)
    new_codes, scales, exponents = quantize_groups(
        value.reshape(rows, cols), moment_format.group_size, moment_format.fmt, moment_format.expand
    )
    codes.copy_(new_codes.reshape(codes.shape))
    state[f"{name}_scales"].copy_(scales)
    if exponents is not None:
        state[f"{name}_exponents"].copy_(exponents)


def _adamw_step_block(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    formats: dict[str, MomentFormat | None],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    amsgrad: bool,
    step: float,
    inv_grad_scale: torch.Tensor | None = None,
) -> int:
    """adamw_step_reference on one block of whole rows (or on a whole tensor)."""
    group_size = next((f.group_size for f in formats.values() if f is not None), 128)
    exact = param.dtype == torch.float32  # update in place, as torch does, when no cast is needed
    p = param if exact else param.float()
    g = grad if grad.dtype == torch.float32 else grad.float()
    if inv_grad_scale is not None:
        g = g * inv_grad_scale
    if maximize:
        g = -g
    exp_avg = read_moment(state, "exp_avg", group_size)
    exp_avg_sq = read_moment(state, "exp_avg_sq", group_size)

    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if amsgrad:
        max_exp_avg_sq = read_moment(state, "max_exp_avg_sq", group_size)
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        write_moment(state, "max_exp_avg_sq", max_exp_avg_sq, formats["max_exp_avg_sq"])
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)

    total = exp_avg + exp_avg_sq
    nonfinite = int((total - total).ne(0).sum())
    write_moment(state, "exp_avg", exp_avg, formats["exp_avg"])
    write_moment(state, "exp_avg_sq", exp_avg_sq, formats["exp_avg_sq"])
    if not exact:
        param.copy_(p)
    return nonfinite


ROW_BLOCK_ELEMENTS = 1 << 20
"""adamw_step_reference updates a large parameter in blocks of whole rows of about this many
elements. The step is some 40 elementwise passes (dequantize, update, requantize); on a whole
tensor every pass streams full-size temporaries through DRAM, on a block they stay in cache:
a 16384x512 parameter took 760 ns/param whole and 190 ns/param in blocks (1 CPU thread,
2026-11-30). Groups never cross a row and the math is per element or per group, so a block
computes what the whole tensor would (checked bit for bit with one CPU thread on 40 shapes,
dtypes and formats, amsgrad included)."""


def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    formats: dict[str, MomentFormat | None],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    amsgrad: bool,
    step: float,
    inv_grad_scale: torch.Tensor | None = None,
) -> int:
    """One AdamW step for one parameter (its local tensor). `step` is already incremented.
    Returns how many moment values came out NaN/Inf (the fused kernel counts the same)."""
    hyper = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
        amsgrad=amsgrad,
        step=step,
        inv_grad_scale=inv_grad_scale,
    )
    rows = param.shape[0] if param.dim() >= 2 else 1
    # A multiple of 64 rows: each block starts at a multiple of 64 elements of every tensor the
    # step touches (per element, per group, padded groups), so torch's vectorised CPU loops chunk
    # a block as they chunk the whole tensor. (A loop's scalar tail can round log2/exp2 in the
    # last bit differently; with aligned blocks the tails fall where the whole tensor's do.)
    block_rows = max(64, ROW_BLOCK_ELEMENTS // max(1, param.numel() // max(rows, 1)) // 64 * 64)
    if param.dim() < 2 or rows < 2 * block_rows:
        return _adamw_step_block(param, grad, state, formats, **hyper)
    moments = {k: v for k, v in state.items() if k != "step"}  # codes, scales, exponents: (rows, ...)
    bad = 0
    for r in range(0, rows, block_rows):
        block = {k: v[r : r + block_rows] for k, v in moments.items()}
        bad += _adamw_step_block(param[r : r + block_rows], grad[r : r + block_rows], block, formats, **hyper)
    return bad
