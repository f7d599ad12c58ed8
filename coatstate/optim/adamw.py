"""CompressedAdamW: torch.optim.AdamW with its moments in the FP8 group format (COAT).

Bookkeeping lives here (param groups, lazy state, GradScaler, state dicts, reporting); the update
math lives in coatstate.optim.reference_step (pure torch, the CPU path) and
coatstate.kernels.adamw_fused with its launcher coatstate.kernels.adamw_launch (Triton, CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch

from coatstate.distributed import (
    check_compressible,
    first_element,
    is_dtensor,
    local_state,
    local_tensor,
    wrap_state,
)
from coatstate.formats.defaults import OPTIMIZER_DEFAULTS
from coatstate.formats.master_weights import CORRECTION_DTYPES
from coatstate.formats.optimizer_state import (
    MASTER_CORRECTION,
    MOMENTS,
    init_moment,
    is_compressed,
    parse_format,
)
from coatstate.optim.base import CompressedOptimizer
from coatstate.optim.foreach_step import adamw_step_foreach, batchable
from coatstate.optim.moments import (
    FORMAT_DEFAULTS,
    global_shape,
    master_mode,
    moment_formats,
)
from coatstate.optim.options import check_arguments, check_master_arguments
from coatstate.optim.reference_step import adamw_step_cpu, adamw_step_reference
from coatstate.optim.state_dict import convert_param_state

logger = logging.getLogger("coatstate")
_DEFAULTS = OPTIMIZER_DEFAULTS


def _options(group: dict) -> tuple:
    """The param-group options a prepared launch depends on (a change, e.g. amsgrad switched on,
    creates states and launches anew)."""
    return (group["amsgrad"], *(group.get(k, v) for k, v in FORMAT_DEFAULTS.items()))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


@dataclasses.dataclass
class _Prepared:
    """A param group's parameters with gradients, sorted into the fused and pure-torch paths."""

    params: list
    fused: list
    twin: list
    launches: list
    options: tuple
    """the group's options that shape states and launches (amsgrad, formats) when prepared"""
    masters: list
    """the parameters that keep a master correction (master_bits 24 or 32 on bfloat16)"""


@dataclasses.dataclass
class _LaunchRecord:
    """The parameters of one fused launch and its on-device non-finite counters."""

    params: list
    launch: Any

    @property
    def nonfinite(self) -> torch.Tensor:
        return self.launch.nonfinite


class CompressedAdamW(CompressedOptimizer):
    """AdamW with FP8 (COAT) first and second moments.

    A `torch.optim.Optimizer` with torch.optim.AdamW's semantics, defaults and hyperparameter
    checks; with `compress=False` it steps exactly as torch.optim.AdamW on float32 parameters
    (float64 and 16-bit parameters get float32 moments where torch keeps the parameter's dtype,
    so their steps differ from torch's by rounding). Which parameters keep float32 moments is
    decided from each parameter's global shape, so sharding never changes precision
    (`uncompressed_parameters()` lists them). Each default is in the signature; those
    of coatstate's own options come from one table, coatstate.formats.defaults (the measurements
    behind them: docs/benchmarks.md).

    Args:
        params (`Iterable`): parameters or param groups, as for torch.optim.AdamW; a group may
            override any option below.
        lr, betas, eps, weight_decay, amsgrad, maximize, foreach: as torch.optim.AdamW.
        fused (`bool | None`): `None` runs the Triton step on CUDA and the pure-torch step
            elsewhere; `True` requires the Triton step; `False` forces pure torch.
        compress (`bool`): store moments in the FP8 group format.
        group_size (`int`): elements per quantization group along a row.
        exp_avg_format, exp_avg_sq_format (`str`): `"e4m3"` or `"e5m2"` (FP8), or 4-bit:
            `"e2m1"` for exp_avg and `"ue3m1_sqrt"` for exp_avg_sq (docs/FORMAT.md).
        exp_avg_expand, exp_avg_sq_expand (`bool | str`): COAT's dynamic range expansion, per
            moment; `"auto"` turns it on for FP8 formats and off for 4-bit ones (which take none).
        min_numel (`int`): parameters with fewer elements keep float32 moments.
        compress_1d (`bool`): also compress 1-D parameters (norm weights and biases stay float32
            otherwise).
        master_bits (`int | str | None`): for bfloat16 parameters, what stands for their float32
            master (coatstate.formats.master_weights): `32` (an int16 remainder: training is bit for
            bit that of float32 parameters), `24` (an int8 correction, within 2**-15 relative), `16`
            (stochastic rounding, no correction) or `None` (updates round to the parameter's
            precision). `"auto"` is 24 for a group of bfloat16 parameters, None otherwise. A weight
            written outside the optimizer (`model.load_state_dict`, `p.copy_` under no_grad, a new
            `p.data`) drops its correction at the next step; a write through `p.data.copy_` is not
            seen.
        master_seed (`int`): keys the stochastic roundings, master_bits=16's and a "ue3m1_sqrt"
            second moment's (saved with the group, so a resume rounds as the original run).
        gradient_release (`bool`): step each parameter in its post-accumulate-grad hook during
            backward and free its gradient; opt.step() and zero_grad() end the iteration.
            `torch.nn.utils.clip_grad_norm_` then sees no gradients: clip with `max_grad_norm`.
        max_grad_norm (`float | None`): with gradient_release, scale each gradient by min(1,
            max_grad_norm / norm) with the previous step's global norm.

    Returns:
        The optimizer. `step(closure=None)` returns the closure's loss (or None); under
        torch.compile the pure-torch step runs eagerly, behind one graph break.

    Raises:
        ValueError: a hyperparameter or a param group's option out of range (checked when the
            group is added), `fused=True` where Triton cannot run, `capturable` or
            `differentiable`, master_bits on float16 parameters.
        TypeError: sparse gradients or complex parameters (at the first step).
        RuntimeError: GradScaler or gradient accumulation with gradient_release=True.

    Example:

    ```python
    import torch
    from coatstate import CompressedAdamW

    model = torch.nn.Linear(256, 256)
    opt = CompressedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ```
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        compress: bool = _DEFAULTS["compress"],
        group_size: int = _DEFAULTS["group_size"],
        exp_avg_format: str = _DEFAULTS["exp_avg_format"],
        exp_avg_sq_format: str = _DEFAULTS["exp_avg_sq_format"],
        exp_avg_expand: bool | str = _DEFAULTS["exp_avg_expand"],
        exp_avg_sq_expand: bool | str = _DEFAULTS["exp_avg_sq_expand"],
        min_numel: int = _DEFAULTS["min_numel"],
        compress_1d: bool = _DEFAULTS["compress_1d"],
        master_bits: int | str | None = _DEFAULTS["master_bits"],
        master_seed: int = _DEFAULTS["master_seed"],
        gradient_release: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        check_arguments(
            lr,
            betas,
            eps,
            weight_decay,
            capturable or differentiable,
            group_size,
            (exp_avg_format, exp_avg_sq_format),
        )
        check_master_arguments(master_seed, gradient_release, max_grad_norm)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=True,
            compress=compress,
            group_size=group_size,
            exp_avg_format=parse_format(exp_avg_format).value,
            exp_avg_sq_format=parse_format(exp_avg_sq_format).value,
            exp_avg_expand=exp_avg_expand,
            exp_avg_sq_expand=exp_avg_sq_expand,
            min_numel=min_numel,
            compress_1d=compress_1d,
            master_bits=master_bits,
            master_seed=master_seed,
        )
        super().__init__(params, defaults, gradient_release, max_grad_norm)
        self._prepared: dict[int, _Prepared] = {}
        """per param group (by id): its parameters sorted into paths, with the fused launches"""
        self._released_launches: dict = {}

    # ---- the step --------------------------------------------------------------------------

    def _init_state(self, p: torch.Tensor, group: dict, on_device: bool) -> dict:
        """p's state, created on first use; a DTensor parameter gets DTensor moments (its local
        rows only: see coatstate.distributed)."""
        state = self.state[p]
        formats = moment_formats(group, global_shape(p))
        if not state:
            local = local_tensor(p)
            if is_dtensor(p) and formats["exp_avg"] is not None:
                check_compressible(p, self._param_name(p))
            state["step"] = torch.tensor(
                0.0, dtype=torch.float32, device=local.device if on_device else "cpu"
            )
            names = MOMENTS if group["amsgrad"] else MOMENTS[:2]
            for name in names:
                init_moment(state, name, local, formats[name])
            if master_mode(group, p) in CORRECTION_DTYPES:  # the weight is exactly its master
                state[MASTER_CORRECTION] = torch.zeros_like(
                    local, dtype=CORRECTION_DTYPES[master_mode(group, p)]
                )
        elif (
            group["amsgrad"] and "max_exp_avg_sq" not in state and not is_compressed(state, "max_exp_avg_sq")
        ):
            init_moment(state, "max_exp_avg_sq", local_tensor(p), formats["max_exp_avg_sq"])
        if is_dtensor(p):
            wrap_state(state, p)
        return state

    def _step_group(self, group: dict, grad_scale, found_inf) -> None:
        prepared = self._prepared.get(id(group))
        with_grad = [p for p in group["params"] if p.grad is not None]
        if prepared is None or not _same(prepared.params, with_grad) or prepared.options != _options(group):
            prepared = self._prepare(group, with_grad)
        self._external_writes.drop_stale(prepared.masters, self.state, self._param_name)
        grads = [local_tensor(p.grad) for p in prepared.fused]
        if prepared.fused:
            from coatstate.kernels import adamw_launch

            if any(g.is_sparse for g in grads) or not adamw_launch.run(
                prepared.launches, group, grads, grad_scale, found_inf
            ):
                prepared = self._prepare(group, with_grad)  # a gradient or parameter changed
                grads = [local_tensor(p.grad) for p in prepared.fused]
                if not adamw_launch.run(prepared.launches, group, grads, grad_scale, found_inf):
                    raise RuntimeError("coatstate: the fused step could not be prepared (please report)")
        if prepared.twin:
            self._twin_step(group, prepared.twin, grad_scale, found_inf)
        self._external_writes.record(prepared.masters)

    def _prepare(self, group: dict, with_grad: list) -> _Prepared:
        """Sort a group's parameters into the fused and pure-torch paths, create their states and
        build the fused launches; done when the set of parameters with gradients changes (the first
        step, a frozen layer, a load), not every step: per-parameter Python is the step's host cost."""
        self._report_once()
        fused, twin = [], []
        for p in with_grad:
            self._check_param(p)
            (fused if self._use_fused(group, p) else twin).append(p)
        launches = []
        if fused:
            from coatstate.kernels import adamw_launch

            launches = adamw_launch.prepare(
                group,
                [local_tensor(p) for p in fused],
                [local_tensor(p.grad) for p in fused],
                [local_state(self._init_state(p, group, on_device=True)) for p in fused],
                [moment_formats(group, global_shape(p)) for p in fused],
                [master_mode(group, p) for p in fused],
                [self._rounding_seed(group, p) for p in fused],
                [first_element(p) for p in fused],
            )
            for key in [k for k in self._fused_cache if k[0] == id(group)]:
                del self._fused_cache[key]  # counters of the launches being replaced
            for launch in launches:  # nonfinite_parameters reads the counters per launch
                self._fused_cache[(id(group), id(launch))] = _LaunchRecord(
                    [fused[i] for i in launch.index], launch
                )
        masters = [p for p in with_grad if master_mode(group, p) in CORRECTION_DTYPES]
        prepared = self._prepared[id(group)] = _Prepared(
            list(with_grad), fused, twin, launches, _options(group), masters
        )
        return prepared

    def _step_released(self, group: dict, p: torch.Tensor) -> None:
        """One parameter's step from its gradient-release hook (its launch prepared once)."""
        masters = [p] if master_mode(group, p) in CORRECTION_DTYPES else []
        self._external_writes.drop_stale(masters, self.state, self._param_name)
        if not self._use_fused(group, p):
            self._twin_step(group, [p], None, None)
            self._external_writes.record(masters)
            return
        from coatstate.kernels import adamw_launch

        grads = [local_tensor(p.grad)]
        launches = self._released_launches.get(id(p))
        if launches is None or not adamw_launch.run(launches, group, grads, None, None):
            self._report_once()
            launches = self._released_launches[id(p)] = adamw_launch.prepare(
                group,
                [local_tensor(p)],
                grads,
                [local_state(self._init_state(p, group, on_device=True))],
                [moment_formats(group, global_shape(p))],
                [master_mode(group, p)],
                [self._rounding_seed(group, p)],
                [first_element(p)],
            )
            for launch in launches:
                self._fused_cache[("released", id(p))] = _LaunchRecord([p], launch)
            adamw_launch.run(launches, group, grads, None, None)
        self._external_writes.record(masters)

    # under torch.compile: run eagerly (one graph break per step) instead of tracing the per-parameter
    # math once per shape and step count, which hits the recompile limit on any real model
    @torch.compiler.disable
    def _twin_step(self, group, params, grad_scale, found_inf) -> None:
        if found_inf is not None and bool(found_inf.item()):
            return  # GradScaler found Inf/NaN in the gradients: skip, as torch does
        inv_scale = None
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()  # exactly GradScaler.unscale_'s
        beta1, beta2 = group["betas"]
        lr = group["lr"]  # a tensor lr stays one: torch.optim.AdamW computes with it in its dtype
        hyper = dict(
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )
        twin_only = group.get("fused") is False  # (the oracle: every parameter on its own)
        batch: dict[float, list] = {}  # step: float32-moment parameters that step together
        for p in params:
            state = self._init_state(p, group, on_device=False)
            state["step"] += 1
            local, g = local_tensor(p), local_tensor(p.grad)
            formats = moment_formats(group, global_shape(p))
            master = master_mode(group, p)
            if not twin_only and batchable(
                local, g, formats, lr=lr, amsgrad=group["amsgrad"], master_bits=master
            ):
                batch.setdefault(state["step"].item(), []).append((p, local, g, local_state(state)))
                continue
            # the compiled CPU step where it applies (fused=None), else the pure-torch twin
            step_fn = adamw_step_reference if twin_only else adamw_step_cpu
            bad = step_fn(
                local,
                g,
                local_state(state),
                formats,
                **hyper,
                amsgrad=group["amsgrad"],
                step=state["step"].item(),
                inv_grad_scale=None if inv_scale is None else inv_scale.to(g.device),
                master_bits=master,
                seed=self._rounding_seed(group, p),
                first_element=first_element(p),
            )
            self._record_twin_nonfinite(p, bad, state)
        for step, members in batch.items():
            ps, locals_, gs, states = zip(*members, strict=True)
            counts = adamw_step_foreach(
                list(locals_),
                list(gs),
                list(states),
                **hyper,
                step=step,
                inv_grad_scale=inv_scale,
            )
            for p, bad in zip(ps, counts, strict=True):
                self._record_twin_nonfinite(p, bad, self.state[p])

    def _record_twin_nonfinite(self, p: torch.Tensor, bad: int, state: dict) -> None:
        if bad:
            count, steps, _ = self._twin_nonfinite.get(p, (0, 0, 0))
            self._twin_nonfinite[p] = (count + bad, steps + 1, int(state["step"].item()))

    # ---- state dicts -----------------------------------------------------------------------

    def _loaded_state(self, state_dict: dict[str, Any]) -> tuple[list, dict]:
        from coatstate.optim.state_dict import loaded_state

        return loaded_state(self.param_groups, state_dict, convert_param_state)

    def _forget_launches(self) -> None:
        self._fused_cache.clear()
        self._prepared.clear()
        self._released_launches.clear()
