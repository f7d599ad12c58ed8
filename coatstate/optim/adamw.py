"""CompressedAdamW: torch.optim.AdamW with its moments in the FP8 group format (COAT).

Bookkeeping lives here (param groups, lazy state, GradScaler, state dicts, reporting); the update
math lives in coatstate.optim.reference_step (pure torch, the CPU path) and
coatstate.kernels.adamw_fused with its launcher coatstate.kernels.adamw_launch (Triton, CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
import math
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
from coatstate.kernels.runtime import triton_usable
from coatstate.optim.external_writes import ExternalWrites
from coatstate.optim.moments import (
    FORMAT_DEFAULTS,
    global_shape,
    master_mode,
    moment_formats,
    optimizer_state_bytes,
    why_uncompressed,
)
from coatstate.optim.options import check_arguments, check_master_arguments, settle_group
from coatstate.optim.reference_step import adamw_step_cpu, adamw_step_reference
from coatstate.optim.release import GradientRelease
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


class CompressedAdamW(torch.optim.Optimizer):
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

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf, as to fused AdamW

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
        super().__init__(params, defaults)
        self._reported: set[int] = set()
        self._fused_cache: dict = {}
        self._prepared: dict[int, _Prepared] = {}
        """per param group (by id): its parameters sorted into paths, with the fused launches"""
        self._twin_nonfinite: dict = {}
        self._external_writes = ExternalWrites()
        self._index_params()
        self._released_launches: dict = {}
        self._release = GradientRelease(self, max_grad_norm) if gradient_release else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            settle_group(len(self.param_groups) - 1, self.param_groups[-1])
        except (ValueError, TypeError):
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise
        self._index_params()
        if getattr(self, "_release", None) is not None:
            self._release.hook_new_groups()

    # ---- reporting -------------------------------------------------------------------------

    def uncompressed_parameters(self) -> list[dict[str, Any]]:
        """Parameters whose moments are kept in float32, with the reason for each."""
        out = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                shape = global_shape(p)
                if moment_formats(group, shape)["exp_avg"] is None:
                    out.append(
                        {
                            "name": names[i] if names else f"group{gi}.param{i}",
                            "shape": tuple(shape),
                            "numel": math.prod(shape),
                            "reason": why_uncompressed(group, shape),
                        }
                    )
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this process (codes, scales, exponents, fp32 moments)."""
        return optimizer_state_bytes(self)

    def _report_once(self) -> None:
        kept = self.uncompressed_parameters()
        key = len(kept)
        if key in self._reported:
            return
        self._reported.add(key)
        if kept:
            n = sum(k["numel"] for k in kept)
            total = sum(math.prod(global_shape(p)) for g in self.param_groups for p in g["params"])
            reasons = sorted(
                {"fewer than min_numel elements" if "min_numel" in k["reason"] else k["reason"] for k in kept}
            )
            logger.info(
                "coatstate: %d of %d parameters (%.2f%% of elements) keep float32 moments (%s); "
                "see CompressedAdamW.uncompressed_parameters()",
                len(kept),
                sum(len(g["params"]) for g in self.param_groups),
                100.0 * n / max(total, 1),
                "; ".join(reasons),
            )

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

    def _index_params(self) -> None:
        # built here, never inside step(): torch.compile refuses attribute writes in a traced step
        self._param_index = {
            id(q): k for k, q in enumerate(q for g in self.param_groups for q in g["params"])
        }

    def _rounding_seed(self, group: dict, p: torch.Tensor) -> int:
        """The seed of p's stochastic roundings (master_bits=16's, a ue3m1_sqrt second moment's):
        the group's master_seed and p's place in the optimizer, so
        that every parameter rounds independently and a resumed run rounds as the original."""
        return (int(group.get("master_seed", 0)) * 1_000_003 + self._param_index.get(id(p), 0)) & 0xFFFFFFFF

    def _param_name(self, p: torch.Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    return names[i] if names else f"group{gi}.param{i}"
        return "<not in this optimizer>"

    @staticmethod
    def _use_fused(group: dict, p: torch.Tensor) -> bool:
        """fused=None: the Triton step on CUDA. fused=True: required (CUDA, or Triton's CPU
        interpreter when TRITON_INTERPRET=1, for tests). fused=False: the pure-torch step."""
        if group.get("fused") is False:
            return False
        local = local_tensor(p)
        required = bool(group.get("fused"))
        if not triton_usable(local.device, interpreter=required):
            if required:
                raise ValueError(
                    f"fused=True needs CUDA tensors with Triton (got a parameter on {local.device}); "
                    "pass fused=None to fall back to the pure-torch step"
                )
            return False
        if not local.is_contiguous() or local.data_ptr() % 16:
            if required:
                raise ValueError("fused=True needs contiguous, 16-byte aligned parameters; pass fused=None")
            return False  # a strided or oddly offset view: the pure-torch step handles it
        return True

    def nonfinite_parameters(self) -> list[dict[str, Any]]:
        """Parameters whose moments have held NaN/Inf since the last call (then reset).

        Per parameter: `count` (moment values that were NaN/Inf, summed over the steps), `steps`
        (how many steps had any) and `last_step`. Counted on the device without synchronising;
        this call synchronises once. A NaN or Inf gradient that GradScaler did not catch shows up
        here instead of silently in a state; a NaN that stays in a moment is counted at every
        step it is there. The policy (docs/FORMAT.md, "Non-finite values"): a non-finite value is
        kept element by element, as torch.optim.AdamW keeps it, and its group's other values keep
        their precision.
        """
        found = []
        for plan in self._fused_cache.values():
            counts = plan.nonfinite.tolist()
            plan.nonfinite.zero_()
            found += [(p, c) for p, c in zip(plan.params, counts, strict=True) if c[0]]
        found += list(self._twin_nonfinite.items())
        self._twin_nonfinite.clear()
        return [
            {"shape": tuple(p.shape), "count": count, "steps": steps, "last_step": last, "param": p}
            for p, (count, steps, last) in found
        ]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self._release is not None:
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError(
                    "coatstate: GradScaler does not work with gradient_release=True (each parameter "
                    "steps during backward, before the scaler can unscale or skip): train in "
                    "bfloat16 autocast, which needs no scaler, or use gradient_release=False"
                )
            self._release.end_iteration()  # gradients set by hand (no hook fired) step below
        for group in self.param_groups:
            prepared = self._prepared.get(id(group))
            with_grad = [p for p in group["params"] if p.grad is not None]
            if (
                prepared is None
                or not _same(prepared.params, with_grad)
                or prepared.options != _options(group)
            ):
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
        return loss

    def _prepare(self, group: dict, with_grad: list) -> _Prepared:
        """Sort a group's parameters into the fused and pure-torch paths, create their states and
        build the fused launches; done when the set of parameters with gradients changes (the first
        step, a frozen layer, a load), not every step: per-parameter Python is the step's host cost."""
        self._report_once()
        fused, twin = [], []
        for p in with_grad:
            if p.grad.is_sparse or p.is_sparse:
                raise TypeError(
                    "CompressedAdamW does not support sparse gradients; use torch.optim.SparseAdam"
                )
            if torch.is_complex(p):
                raise TypeError(
                    "CompressedAdamW does not support complex parameters; view them as real "
                    "(torch.view_as_real) or use torch.optim.AdamW"
                )
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
        for p in params:
            state = self._init_state(p, group, on_device=False)
            state["step"] += 1
            g = local_tensor(p.grad)
            # the compiled CPU step where it applies (fused=None), else the pure-torch twin
            step_fn = adamw_step_reference if group.get("fused") is False else adamw_step_cpu
            bad = step_fn(
                local_tensor(p),
                g,
                local_state(state),
                moment_formats(group, global_shape(p)),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                maximize=group["maximize"],
                amsgrad=group["amsgrad"],
                step=state["step"].item(),
                inv_grad_scale=None if inv_scale is None else inv_scale.to(g.device),
                master_bits=master_mode(group, p),
                seed=self._rounding_seed(group, p),
                first_element=first_element(p),
            )
            if bad:
                count, steps, _ = self._twin_nonfinite.get(p, (0, 0, 0))
                self._twin_nonfinite[p] = (count + bad, steps + 1, int(state["step"].item()))

    # ---- state dicts -----------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a CompressedAdamW or a torch.optim.AdamW state dict (compressing it as configured).

        As torch.optim.Optimizer.load_state_dict: the load_state_dict pre-hooks run first (one
        may return a new dict), the post-hooks last; keys an older torch did not write
        (maximize, foreach, ...) get torch's defaults; a loaded group without param_names keeps
        this optimizer's. Hyperparameters come from the loaded dict; coatstate's format keys that
        it lacks (an AdamW dict) keep this optimizer's values. Moments are converted to this
        optimizer's format for each parameter; states are never cast to the parameter's dtype.
        Everything is checked and converted before anything changes: a dict that is refused
        (ValueError) leaves the optimizer as it was.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        from coatstate.optim.state_dict import loaded_state

        # everything checked and converted first: a refused dict changes nothing
        new_groups, new_state = loaded_state(self.param_groups, state_dict, convert_param_state)
        for mine, merged in zip(self.param_groups, new_groups, strict=True):  # in place: references hold
            mine.clear()
            mine.update(merged)
        self.state.clear()
        self.state.update(new_state)
        self._fused_cache.clear()
        self._prepared.clear()
        self._released_launches.clear()
        self._twin_nonfinite.clear()
        self._external_writes.forget()
        self._index_params()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
