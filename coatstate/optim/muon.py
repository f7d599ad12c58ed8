"""CompressedMuon: torch.optim.Muon with its momentum buffer in the library's group formats."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from coatstate.distributed import is_dtensor
from coatstate.formats.defaults import MOMENTUM_DEFAULTS
from coatstate.formats.optimizer_state import MOMENTUM
from coatstate.optim.base import CompressedOptimizer, own_options
from coatstate.optim.momentum_options import check_muon_arguments, check_muon_group, check_muon_params
from coatstate.optim.momentum_step import muon_momentum, muon_step

_D = MOMENTUM_DEFAULTS
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""torch.optim.Muon's (Keller Jordan's) Newton-Schulz coefficients"""


class CompressedMuon(CompressedOptimizer):
    """Muon (Newton-Schulz orthogonalised momentum) with its momentum buffer in FP8 or 4 bits.

    A `torch.optim.Optimizer` with torch.optim.Muon's semantics, defaults and checks (torch >=
    2.9): m = lerp(m, g, 1 - momentum); the update is g.lerp(m, momentum) with nesterov, else m;
    it is orthogonalised by `ns_steps` quintic Newton-Schulz iterations (bfloat16 torch matmuls,
    as torch's); p *= 1 - lr * weight_decay; p -= adjusted_lr * update. With `compress=False` it
    steps exactly as torch.optim.Muon on float32 parameters. Muon is for the hidden 2-D weights:
    step embeddings, the output head and 1-D parameters with CompressedAdamW (README, "Muon").

    Args:
        params (`Iterable`): 2-D parameters or param groups; a group may override any option below.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            torch.optim.Muon (`adjust_lr_fn`: None or "original" (sqrt(max(1, rows / cols))), or
            "match_rms_adamw" (0.2 * sqrt(max(rows, cols)))).
        fused (`bool | None`): `None` fuses the momentum accumulation (decode, lerp, encode) in
            one Triton pass on CUDA; `True` requires Triton; `False` forces pure torch.
            Newton-Schulz is torch matmuls either way.
        compress, group_size, min_numel, master_bits, master_seed, gradient_release,
            max_grad_norm: as CompressedAdamW's.
        momentum_format (`str`): `"e4m3"` or `"e5m2"` (FP8), or `"e2m1"` (4-bit).
        momentum_expand (`bool | str`): COAT's dynamic range expansion; `"auto"`: on for FP8.

    Returns:
        The optimizer. `step(closure=None)` returns the closure's loss (or None).

    Raises:
        ValueError: torch.optim.Muon's refusals (a parameter that is not 2-D, negative lr,
            momentum or weight_decay, an unknown adjust_lr_fn), a bad format option.
        TypeError: sparse gradients, complex or DTensor parameters (at the first step).

    Example:

    ```python
    import torch
    from coatstate import CompressedAdamW, CompressedMuon

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    hidden = [p for p in model[0].parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    opts = [CompressedMuon(hidden, lr=0.02), CompressedAdamW(rest, lr=3e-4)]
    model(torch.randn(8, 256)).square().mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    ```
    """

    MOMENTS = (MOMENTUM,)
    OPTION_MOMENTS = (MOMENTUM,)
    LOAD_DEFAULTS = {"fused": None}
    HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "ns_steps", "eps",
                       "adjust_lr_fn")  # fmt: skip
    REFERENCE = "torch.optim.Muon"

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        fused: bool | None = None,
        compress: bool = _D["compress"],
        group_size: int = _D["group_size"],
        momentum_format: str = _D["momentum_format"],
        momentum_expand: bool | str = _D["momentum_expand"],
        min_numel: int = _D["min_numel"],
        master_bits: int | str | None = _D["master_bits"],
        master_seed: int = _D["master_seed"],
        gradient_release: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        check_muon_arguments(lr, momentum, weight_decay, adjust_lr_fn)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            fused=fused,
            **own_options(MOMENTUM, locals()),
        )
        super().__init__(params, defaults, gradient_release, max_grad_norm)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_muon_params(params)  # torch's refusal, before torch's own add_param_group
        super().add_param_group({**param_group, "params": params})

    def _check_group(self, gi: int, group: dict) -> None:
        check_muon_group(gi, group)

    def _check_param(self, p: torch.Tensor) -> None:
        super()._check_param(p)
        if is_dtensor(p):
            raise TypeError(
                "CompressedMuon orthogonalises whole matrices, and a DTensor parameter holds a shard: "
                "step it with CompressedAdamW, or keep Muon's matrices unsharded"
            )

    def _update(self, param, grad, state, group, p, step, fused) -> int:
        accumulate = muon_momentum
        if fused and grad.dtype == torch.float32:
            from coatstate.kernels.momentum_fused import launchable, muon_accumulate_fused

            if launchable(self._formats(group, p)[MOMENTUM]):
                accumulate = muon_accumulate_fused
        twin = functools.partial(muon_step, accumulate=accumulate)
        return self._apply(twin, None, param, grad, state, group, p, step, fused)
