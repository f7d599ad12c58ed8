"""CompressedLion: Lion (Chen et al. 2023) with its momentum in the library's group formats."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from coatstate.formats.defaults import LION_DEFAULTS
from coatstate.optim.base import CompressedOptimizer, own_options
from coatstate.optim.momentum_options import check_lion_arguments, check_lion_group
from coatstate.optim.momentum_step import lion_step

_D = LION_DEFAULTS
LION_GROUP_DEFAULTS = {"maximize": False, "fused": None}
"""what a loaded param group that lacks the key gets (lion-pytorch's groups have neither)"""


class CompressedLion(CompressedOptimizer):
    """Lion (Chen et al. 2023, arXiv 2302.06675), its momentum in FP8 (COAT's group format) or 4 bits.

    Per element, in float32 and in lion-pytorch's order: p *= 1 - lr * weight_decay (decoupled
    weight decay); p -= lr * sign(b1 * m + (1 - b1) * g); m = b2 * m + (1 - b2) * g. There is no
    torch reference: with `compress=False` it equals the plain float32 Lion of
    tests/optim/test_sgd_lion_muon.py bit for bit, and loads lion-pytorch's state dicts (whose
    momentum is also named exp_avg).

    Args:
        params (`Iterable`): parameters or param groups; a group may override any option below.
        lr (`float | Tensor`): the learning rate (the paper's: 3-10x smaller than AdamW's).
        betas (`tuple[float, float]`): b1 (the update's interpolation) and b2 (the momentum's).
        weight_decay (`float`): decoupled weight decay (3-10x larger than AdamW's, per the paper).
        maximize (`bool`): ascend instead.
        fused (`bool | None`): `None` runs the fused Triton step on CUDA, pure torch elsewhere;
            `True` requires Triton; `False` forces pure torch.
        compress, group_size, min_numel, compress_1d, master_bits, master_seed, gradient_release,
            max_grad_norm: as CompressedAdamW's.
        exp_avg_format (`str`): `"e4m3"` or `"e5m2"` (FP8), or `"e2m1"` (4-bit).
        exp_avg_expand (`bool | str`): COAT's dynamic range expansion; `"auto"`: on for FP8.

    Returns:
        The optimizer. `step(closure=None)` returns the closure's loss (or None).

    Raises:
        ValueError: a negative lr or weight_decay, betas outside [0, 1], a bad format option.
        TypeError: sparse gradients or complex parameters (at the first step).

    Example:

    ```python
    import torch
    from coatstate import CompressedLion

    model = torch.nn.Linear(256, 256)
    opt = CompressedLion(model.parameters(), lr=1e-4, weight_decay=1.0)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ```
    """

    MOMENTS = ("exp_avg",)
    OPTION_MOMENTS = ("exp_avg",)
    LOAD_DEFAULTS = LION_GROUP_DEFAULTS
    HYPERPARAMETERS = ("lr", "betas", "weight_decay", "maximize")
    REFERENCE = "a float32 Lion"

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        fused: bool | None = None,
        compress: bool = _D["compress"],
        group_size: int = _D["group_size"],
        exp_avg_format: str = _D["exp_avg_format"],
        exp_avg_expand: bool | str = _D["exp_avg_expand"],
        min_numel: int = _D["min_numel"],
        compress_1d: bool = _D["compress_1d"],
        master_bits: int | str | None = _D["master_bits"],
        master_seed: int = _D["master_seed"],
        gradient_release: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        check_lion_arguments(lr, betas, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            weight_decay=weight_decay,
            maximize=maximize,
            fused=fused,
            **own_options("exp_avg", locals()),
        )
        super().__init__(params, defaults, gradient_release, max_grad_norm)

    def _check_group(self, gi: int, group: dict) -> None:
        check_lion_group(gi, group)

    def _update(self, param, grad, state, group, p, step, fused) -> int:
        kernel = None
        if fused:
            from coatstate.kernels.momentum_fused import lion_fused

            kernel = lion_fused
        return self._apply(lion_step, kernel, param, grad, state, group, p, step, fused)
