"""The pure-torch AdamW step over group-compressed moments (FP8 or 4-bit): the CPU path and the oracle of
the fused Triton step (coatstate.kernels.adamw_fused).

The update is torch.optim.AdamW's single-tensor update, op for op and in its order, in float32:
  p *= 1 - lr*wd;  m.lerp_(g, 1-b1);  v = v*b2 + (1-b2)*g*g;
  denom = sqrt(v) / sqrt(1 - b2**t) + eps;  p -= (lr / (1 - b1**t)) * m / denom
with the bias corrections and step size computed from Python floats (float64), as torch does.
A moment that is compressed is dequantized before and requantized after; one that is not is
updated in place, so with nothing compressed the result equals torch.optim.AdamW bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from coatstate.formats import master_weights
from coatstate.formats.optimizer_state import (
    DEFAULT_GROUP_SIZE,
    MASTER_CORRECTION,
    MomentFormat,
    read_moment,
    write_moment,
)


def _correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """float32 sqrt rounded to nearest (a float64 sqrt rounded once more is exact for float32)."""
    return x.double().sqrt().float()


def _adamw_step_block(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    formats: dict[str, MomentFormat | None],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    amsgrad: bool,
    step: float,
    inv_grad_scale: torch.Tensor | None = None,
    master_bits: int | None = None,
    seed: int = 0,
    first_element: int = 0,
) -> int:
    """adamw_step_reference on one block of whole rows (or on a whole tensor) whose first element
    is element `first_element` of the parameter."""
    group_size = next((f.group_size for f in formats.values() if f is not None), DEFAULT_GROUP_SIZE)
    exact = param.dtype == torch.float32  # update in place, as torch does, when no cast is needed
    if master_bits == 32:
        p = master_weights.join32(param, state[MASTER_CORRECTION])
    elif master_bits == 24:
        p = master_weights.join24(param, state[MASTER_CORRECTION])
    else:
        p = param if exact else param.float()
    g = grad if grad.dtype == torch.float32 else grad.float()
    if inv_grad_scale is not None:
        g = g * inv_grad_scale
    if maximize:
        g = -g
    shape = tuple(param.shape)
    exp_avg = read_moment(state, "exp_avg", group_size, formats["exp_avg"], shape)
    exp_avg_sq = read_moment(state, "exp_avg_sq", group_size, formats["exp_avg_sq"], shape)

    if isinstance(lr, torch.Tensor):  # torch does this arithmetic in the tensor's dtype: so here
        lr = lr.to(p.device).reshape(())
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    # torch's CPU float32 sqrt can be 1 ulp off (a vectorized approximation): compressed moments
    # take the correctly rounded one, which the compiled CPU step computes too; uncompressed ones
    # keep torch's, to stay torch.optim.AdamW's bits
    compressed = formats["exp_avg_sq"] is not None
    sqrt = _correctly_rounded_sqrt if compressed else torch.sqrt
    if amsgrad:
        max_exp_avg_sq = read_moment(state, "max_exp_avg_sq", group_size, formats["max_exp_avg_sq"], shape)
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (sqrt(max_exp_avg_sq) / bias_correction2_sqrt).add_(eps)
        write_moment(state, "max_exp_avg_sq", max_exp_avg_sq, formats["max_exp_avg_sq"])
    else:
        denom = (sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)

    total = exp_avg + exp_avg_sq
    nonfinite = int((total - total).ne(0).sum())
    write_moment(state, "exp_avg", exp_avg, formats["exp_avg"])
    # a 4-bit second moment rounds stochastically (unbiased), or its EMA stalls between levels
    write_moment(state, "exp_avg_sq", exp_avg_sq, formats["exp_avg_sq"], (seed, int(step), first_element))
    if master_bits in (32, 24):
        w, correction = (master_weights.split32 if master_bits == 32 else master_weights.split24)(p)
        param.copy_(w)
        state[MASTER_CORRECTION].copy_(correction)
    elif master_bits == 16:
        param.copy_(master_weights.stochastic_round_bf16(p, seed, int(step), first_element))
    elif not exact:
        param.copy_(p)
    return nonfinite


ROW_BLOCK_ELEMENTS = 1 << 20
"""adamw_step_reference updates a large parameter in blocks of whole rows of about this many
elements. The step is a long chain of elementwise passes (dequantize, update, requantize); on a
whole tensor every pass streams full-size temporaries through DRAM, on a block they stay in cache
(docs/performance.md has the measurement). Groups never cross a row and the math is per element or
per group, so a block computes what the whole tensor would, bit for bit (tests/optim/test_adamw.py)."""


def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    formats: dict[str, MomentFormat | None],
    first_element: int = 0,
    **hyper: Any,
) -> int:
    """One AdamW step for one parameter (its local tensor), the hyperparameters as keywords of
    `_adamw_step_block` (lr, beta1, beta2, eps, weight_decay, maximize, amsgrad, step: already
    incremented; inv_grad_scale, master_bits, seed). With `master_bits` (a bfloat16 parameter)
    the update runs on the float32 master that the parameter and its state's correction stand for
    (coatstate.formats.master_weights); `seed` keys master_bits=16's stochastic rounding and a
    4-bit second moment's, with each element's offset in the global tensor (the local tensor
    starting at `first_element`: a dim-0 shard's place), so a sharded run rounds as one process.
    Returns how many moment values came out NaN/Inf (the fused kernel counts the same)."""
    rows = param.shape[0] if param.dim() >= 2 else 1
    # whole rows, a multiple of 64 of them: a block's tensors start where the whole tensor's
    # vectorised loops would cut them (the codec's bits no longer depend on it; the alignment
    # costs nothing and keeps the blocks' loops as fast as the whole tensor's)
    block_rows = max(64, ROW_BLOCK_ELEMENTS // max(1, param.numel() // max(rows, 1)) // 64 * 64)
    if param.dim() < 2 or rows < 2 * block_rows:
        return _adamw_step_block(param, grad, state, formats, first_element=first_element, **hyper)
    moments = {k: v for k, v in state.items() if k != "step"}  # codes, scales, exponents: (rows, ...)
    bad = 0
    for r in range(0, rows, block_rows):
        block = {k: v[r : r + block_rows] for k, v in moments.items()}
        part = param[r : r + block_rows]
        first = first_element + r * (param.numel() // rows)
        bad += _adamw_step_block(part, grad[r : r + block_rows], block, formats, first_element=first, **hyper)
    return bad


def adamw_step_cpu(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    formats: dict[str, MomentFormat | None],
    first_element: int = 0,
    **hyper: Any,
) -> int:
    """adamw_step_reference's step through the compiled CPU kernel (coatstate.kernels.cpu_step)
    where it covers the parameter, bit for bit the same; the twin otherwise."""
    from coatstate.kernels import cpu_step

    bad = cpu_step.adamw_step(param, grad, state, formats, first_element=first_element, **hyper)
    if bad is None:
        bad = adamw_step_reference(param, grad, state, formats, first_element=first_element, **hyper)
    return bad
