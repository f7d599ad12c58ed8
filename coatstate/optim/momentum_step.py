"""The pure-torch steps of CompressedSGD, CompressedLion and CompressedMuon: the CPU path and the
oracle of the fused Triton momentum step (coatstate.kernels.momentum_fused).

Each is its reference's single-tensor update, op for op and in its order, in float32 (torch's
_single_tensor_sgd and _single_tensor_muon; Lion as lion-pytorch writes Chen et al. 2023). A
compressed momentum is dequantized before and requantized after; an uncompressed one is updated
in place, so with nothing compressed each equals its reference bit for bit. The parameter update
reads the momentum's float32 value before requantization, as CompressedAdamW's step does.
"""

from __future__ import annotations

import math

import torch

from coatstate.formats import master_weights
from coatstate.formats.optimizer_state import (
    DEFAULT_GROUP_SIZE,
    MASTER_CORRECTION,
    MomentFormat,
    init_moment,
    is_compressed,
    read_moment,
    write_moment,
)


def read_momentum(state: dict, name: str, fmt: MomentFormat | None, shape: tuple) -> torch.Tensor | None:
    """Momentum `name` as float32 (the state's own tensor when uncompressed), or None before the
    first step that creates it."""
    if name not in state and not is_compressed(state, name):
        return None
    return read_moment(state, name, fmt.group_size if fmt else DEFAULT_GROUP_SIZE, fmt, shape)


def write_momentum(state: dict, name: str, value: torch.Tensor, fmt: MomentFormat | None) -> int:
    """Store float32 `value` as momentum `name` (created on first use); returns how many of its
    values are NaN/Inf (reported by nonfinite_parameters, never hidden)."""
    if name not in state and not is_compressed(state, name):
        init_moment(state, name, value, fmt)
    write_moment(state, name, value, fmt)
    return int((value - value).ne(0).sum())


def master_in(param: torch.Tensor, state: dict, master_bits: int | None) -> torch.Tensor:
    """The float32 value the update runs on: the master a bfloat16 weight and its correction stand
    for, a float32 parameter itself (updated in place, as torch does), or a float32 copy."""
    if master_bits == 32:
        return master_weights.join32(param, state[MASTER_CORRECTION])
    if master_bits == 24:
        return master_weights.join24(param, state[MASTER_CORRECTION])
    return param if param.dtype == torch.float32 else param.float()


def master_out(
    param: torch.Tensor,
    p: torch.Tensor,
    state: dict,
    master_bits: int | None,
    seed: int,
    step: int,
    first: int,
) -> None:
    """Write the updated float32 `p` back as `param` (and its master correction)."""
    if master_bits in (32, 24):
        w, correction = (master_weights.split32 if master_bits == 32 else master_weights.split24)(p)
        param.copy_(w)
        state[MASTER_CORRECTION].copy_(correction)
    elif master_bits == 16:
        param.copy_(master_weights.stochastic_round_bf16(p, seed, step, first))
    elif p is not param:
        param.copy_(p)


def sgd_step(
    p: torch.Tensor, grad: torch.Tensor, state: dict, fmt: MomentFormat | None, *, lr, momentum: float,
    dampening: float, nesterov: bool, weight_decay, maximize: bool,
) -> int:  # fmt: skip
    """torch.optim.SGD's _single_tensor_sgd on float32 `p` (in place). The buffer is created from
    the first gradient, as torch does (a clone, not a decayed zero)."""
    grad = grad if not maximize else -grad
    if weight_decay != 0:
        grad = grad.add(p, alpha=weight_decay)
    bad = 0
    if momentum != 0:
        buf = read_momentum(state, "momentum_buffer", fmt, tuple(p.shape))
        if buf is None:
            buf = grad.detach().clone()
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        bad = write_momentum(state, "momentum_buffer", buf, fmt)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    p.add_(grad, alpha=-lr)
    return bad


def lion_step(
    p: torch.Tensor, grad: torch.Tensor, state: dict, fmt: MomentFormat | None, *, lr, betas,
    weight_decay: float,
    maximize: bool,
) -> int:  # fmt: skip
    """Lion (Chen et al. 2023, Algorithm 2) on float32 `p`, in lion-pytorch's op order: decoupled
    weight decay, the sign of the interpolation c = b1*m + (1-b1)*g, then m = b2*m + (1-b2)*g."""
    beta1, beta2 = betas
    grad = grad if not maximize else -grad
    exp_avg = read_momentum(state, "exp_avg", fmt, tuple(p.shape))
    if exp_avg is None:
        exp_avg = torch.zeros_like(p, dtype=torch.float32)
    p.mul_(1 - lr * weight_decay)
    update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
    p.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
    return write_momentum(state, "exp_avg", exp_avg, fmt)


def muon_momentum(
    state: dict, grad: torch.Tensor, fmt: MomentFormat | None, momentum: float, nesterov: bool
) -> tuple[torch.Tensor, int]:
    """torch.optim.Muon's momentum accumulation on the stored buffer (zeros at first); returns
    (the update that Newton-Schulz orthogonalises, how many buffer values are NaN/Inf)."""
    buf = read_momentum(state, "momentum_buffer", fmt, tuple(grad.shape))
    if buf is None:
        buf = torch.zeros_like(grad, dtype=torch.float32)
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    return update, write_momentum(state, "momentum_buffer", buf, fmt)


def zeropower_via_newtonschulz(
    grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float
) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz, op for op (torch's is private): the quintic
    Newton-Schulz iteration in bfloat16 matmuls, on the wide orientation of the matrix."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    ortho = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


def adjust_lr(lr, adjust_lr_fn: str | None, shape: torch.Size):
    """torch.optim.Muon's learning-rate adjustment to the matrix's shape."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def muon_step(
    p: torch.Tensor, grad: torch.Tensor, state: dict, fmt: MomentFormat | None, *, lr, weight_decay: float,
    momentum: float, nesterov: bool, ns_coefficients, ns_steps: int, eps: float, adjust_lr_fn: str | None,
    accumulate=muon_momentum,
) -> int:  # fmt: skip
    """torch.optim.Muon's _single_tensor_muon on float32 `p` (in place). `accumulate` is the
    momentum accumulation: muon_momentum, or the fused kernel's (decode, lerp, encode in one pass)."""
    if grad.ndim != 2:
        raise ValueError("Param gradient must be a 2D matrix")
    update, bad = accumulate(state, grad, fmt, momentum, nesterov)
    update = zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    p.mul_(1 - lr * weight_decay)
    p.add_(update, alpha=-adjust_lr(lr, adjust_lr_fn, p.shape))
    return bad
