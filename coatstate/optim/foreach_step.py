"""CompressedAdamW's CPU step for the parameters that keep float32 moments (norm weights, biases,
tensors under `min_numel`), all at once with torch's foreach ops.

Each such parameter steps as reference_step.adamw_step_reference steps it, which is torch's
single-tensor AdamW: the same operations in the same order. On a CPU a foreach op runs those very
kernels one tensor after another, so the bits are the same (tests/optim/test_foreach_step.py),
but one call covers every tensor: the dozen op calls a parameter costs from Python are paid once
per step instead of once per parameter. A model has many such small tensors (a GPT block has
eight), and on a CPU their Python, not their arithmetic, was their step time.

Covered: float32 parameters and gradients on the CPU, a float lr, no amsgrad, no master weights,
at most MAX_NUMEL elements. Any other parameter takes the per-parameter path.
"""

from __future__ import annotations

import torch

from coatstate.formats.optimizer_state import MomentFormat

MAX_NUMEL = 1 << 16
"""Larger tensors step one at a time: their arithmetic outweighs their Python, and a batch would
allocate the temporaries of all of them at once (compress=False's whole model)."""


def batchable(
    param: torch.Tensor,
    grad: torch.Tensor,
    formats: dict[str, MomentFormat | None],
    *,
    lr: float | torch.Tensor,
    amsgrad: bool,
    master_bits: int | None,
) -> bool:
    """Whether adamw_step_foreach covers this parameter (its local tensor and gradient)."""
    return (
        formats["exp_avg"] is None
        and formats["exp_avg_sq"] is None
        and not amsgrad
        and master_bits is None
        and not isinstance(lr, torch.Tensor)
        and param.dtype == torch.float32
        and grad.dtype == torch.float32
        and param.device.type == "cpu"
        and grad.device == param.device
        and grad.shape == param.shape
        and param.numel() <= MAX_NUMEL
    )


def adamw_step_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    step: float,
    inv_grad_scale: torch.Tensor | None = None,
) -> list[int]:
    """One AdamW step of `params` (local tensors that `batchable` accepted, all at the same `step`,
    already incremented), their float32 moments in `states`, in place. Returns each parameter's
    count of moment values that came out NaN/Inf, as the per-parameter step counts them."""
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    if inv_grad_scale is not None:
        grads = torch._foreach_mul(grads, inv_grad_scale)
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)
    # total - total is NaN exactly where m + v is NaN or Inf; the 0-norm counts those
    totals = torch._foreach_add(exp_avgs, exp_avg_sqs)
    torch._foreach_sub_(totals, totals)
    return [int(n) for n in torch.stack(torch._foreach_norm(totals, 0)).tolist()]
