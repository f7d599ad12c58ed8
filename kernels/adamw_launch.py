"""Host side of the fused CompressedAdamW step: launch plans, the per-step launch, the custom op.

A `Launch` groups the parameters of a param group that share dtypes and moment formats; its
`_Plan` holds the address tables the kernel (kernels/adamw_fused.py) reads. Both are built once,
when the parameter set changes; a step then costs a few small host->device copies and launches,
with no synchronisation: lr, the step counts, GradScaler's scale and found_inf stay on the device.
Eager steps call the kernel directly; under torch.compile the step is the registered op
torch.ops.coatstate.fused_adamw_, whose fake implementation lets fake tensors trace through it.
"""

from __future__ import annotations

import torch
import triton

from ..formats.group import group_layout
from ..formats.optimizer_state import (
    CODES,
    DEFAULT_GROUP_SIZE,
    EXPONENTS,
    MASTER_CORRECTION,
    MOMENTS,
    SCALES,
    MomentFormat,
    is_compressed,
    parse_format,
    state_keys,
)
from . import adamw_fused as kernel
from .adamw_fused import (
    B2,
    BLOCK_COLUMNS,
    BLOCK_INDEX,
    BLOCK_TENSOR,
    DECAY,
    EPS,
    FIRST,
    GROUPS_PER_ROW,
    HYPER_COLUMNS,
    INV_BC2_SQRT,
    M_CODES,
    META_COLUMNS,
    N_COLS,
    N_GROUPS,
    NONFINITE_COLUMNS,
    SCALAR_COLUMNS,
    SEED,
    STEP,
    STEP_SIZE,
    TABLE_COLUMNS,
    TO_EXPS,
    TO_SCALES,
    V_CODES,
    W1,
    W2,
    X_CODES,
    C,
    G,
    P,
    _adamw_kernel,
    by_column,
    format_constexprs,
)
from .fp4_triton import UE3M1_SQRT
from .runtime import interpreting


class _Plan:
    """Everything about a launch that stays fixed from step to step (rebuilt when params/states change)."""

    def __init__(self, params, states, group_size, device, seeds=None, firsts=None):
        self.gpp = kernel.groups_per_program(interpreting())
        self.bases = {P: params[0]}
        table, meta, blocks = [], [], []
        for i, (p, s) in enumerate(zip(params, states, strict=True)):
            row = {P: _offset(p, self.bases[P]), STEP: s["step"].data_ptr()}
            for codes, name in zip((M_CODES, V_CODES, X_CODES), MOMENTS, strict=True):
                data = s.get(name + CODES, s.get(name))
                if data is None:
                    continue
                self.bases.setdefault(codes, data)
                row[codes] = _offset(data, self.bases[codes])
                if is_compressed(s, name):
                    row[codes + TO_SCALES] = s[name + SCALES].data_ptr()
                    if name + EXPONENTS in s:
                        row[codes + TO_EXPS] = s[name + EXPONENTS].data_ptr()
            if MASTER_CORRECTION in s:
                self.bases.setdefault(C, s[MASTER_CORRECTION])
                row[C] = _offset(s[MASTER_CORRECTION], self.bases[C])
            table.append(by_column(row, TABLE_COLUMNS, fill=0))
            rows, cols, gpr = group_layout(p.shape, group_size)
            n_groups = rows * gpr if p.numel() else 0
            # keyed as master_weights.random_bits keys it
            seed = 0 if seeds is None else (seeds[i] * 0x9E3779B1) & 0xFFFFFFFF
            # the local tensor's first element in the global one (a shard's), mod 2**32 as hashed
            first = 0 if firsts is None else firsts[i] & 0xFFFFFFFF
            shape = {N_COLS: cols, GROUPS_PER_ROW: gpr, N_GROUPS: n_groups}
            meta.append(by_column({**shape, SEED: seed, FIRST: first}, META_COLUMNS))
            nb = triton.cdiv(n_groups, self.gpp)
            tensor, index = torch.full((nb,), i, dtype=torch.int32), torch.arange(nb, dtype=torch.int32)
            blocks.append(
                torch.stack(by_column({BLOCK_TENSOR: tensor, BLOCK_INDEX: index}, BLOCK_COLUMNS), 1)
            )
        self.table = torch.tensor(table, dtype=torch.int64)
        self.meta = torch.tensor(meta, dtype=torch.int64).to(device)
        self.blocks = torch.cat(blocks).to(device)
        self.n_blocks = self.blocks.shape[0]
        self.even = all(m[N_COLS] % group_size == 0 for m in meta)
        """every row is whole groups (the kernel's EVEN tiles, unless launch_even says otherwise)"""
        self.even_firsts = all(m[FIRST] % 2 == 0 for m in meta)
        """every tensor starts at an even offset of its global tensor"""
        self.steps = [s["step"] for s in states]
        self.params = list(params)
        self._constants: dict | None = None
        self.master_bits: int | None = None
        """the bfloat16 parameters' master-weight mode; set by the owner of the plan"""
        self.nonfinite: torch.Tensor | None = None
        """per tensor: how many moment values came out NaN/Inf (counted on the device; the caller's)"""

    def launch_even(self, fm, fv) -> bool:
        """The kernel's EVEN: whole-group rows, and where a 4-bit second moment rounds
        stochastically also even first offsets (its hash serves pairs of neighbours, which an odd
        offset would split; the per-element path handles those)."""
        pairs = fm is not None and self.constants(fm, fv)["V_FMT"].FP4 == UE3M1_SQRT
        return self.even and (self.even_firsts or not pairs)

    def constants(self, fm, fv) -> dict:
        """The kernel's format constexprs (computed once per plan: they cost host time per step)."""
        if self._constants is None:
            self._constants = format_constexprs(fm, fv)
        return self._constants


def _scalars(group: dict, steps: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device tensors: hyper = float32 [1 - lr*wd, 1 - b1, b2, 1 - b2, eps] and, per tensor,
    [lr / (1 - b1**t), 1 / sqrt(1 - b2**t)] from the device step counts t, in float64 as torch
    computes them, then rounded to float32. A few tiny launches, no host synchronisation."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    lr = lr.detach().to(device, torch.float64).reshape(()) if isinstance(lr, torch.Tensor) else float(lr)
    t = torch.stack(steps).double()
    bias_correction1 = 1 - torch.pow(beta1, t)
    bias_correction2 = 1 - torch.pow(beta2, t)
    scalars = {STEP_SIZE: lr / bias_correction1, INV_BC2_SQRT: bias_correction2.rsqrt()}
    scalars = torch.stack(by_column(scalars, SCALAR_COLUMNS), 1).float()
    decay = 1 - lr * group["weight_decay"]
    hyper = {DECAY: decay if isinstance(lr, float) else 0.0, W1: 1 - beta1, B2: beta2, W2: 1 - beta2}
    hyper = torch.tensor(by_column({**hyper, EPS: group["eps"]}, HYPER_COLUMNS), dtype=torch.float32)
    hyper = _to_device(hyper, device)  # one host->device copy
    if not isinstance(lr, float):  # a device lr: its decay is written on the device
        hyper[int(DECAY)] = decay.float()
    return hyper, scalars


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from `base` to `t` (same dtype; both 16-byte aligned, checked by the caller)."""
    return (t.data_ptr() - base.data_ptr()) // t.element_size()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a sync: through pinned memory (the pinned block is reused only
    after the copy completes: torch's host allocator records the copy's stream)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Launch:
    """One kernel launch of a step: the parameters of a param group that share dtypes and moment
    formats, with their states and the launch plan (address tables). Built by `prepare` when the
    parameter set changes, then reused every step while parameters and states stay in place."""

    def __init__(
        self, index, params, grads, states, fm, fv, group_size, master_bits=None, seeds=None, firsts=None
    ) -> None:
        self.index = index
        """positions of these parameters in the caller's list"""
        self.params, self.states, self.fm, self.fv = params, states, fm, fv
        self.master_bits = master_bits
        """the bfloat16 parameters' master-weight mode (formats.master_weights), or None"""
        self.seeds = list(seeds) if seeds is not None else [0] * len(params)
        self.firsts = list(firsts) if firsts is not None else [0] * len(params)
        self.group_size = fm.group_size if fm is not None else group_size
        if self.group_size & (self.group_size - 1):
            raise ValueError(
                f"the fused step needs a power-of-two group_size; got {self.group_size} (use fused=False)"
            )
        self.grad_dtype = grads[0].dtype
        self.addresses = [p.data_ptr() for p in params]
        device = params[0].device
        self.nonfinite = torch.zeros((len(params), NONFINITE_COLUMNS), dtype=torch.int32, device=device)
        """per parameter: the kernel's non-finite counters (adamw_fused's BAD_VALUES, BAD_STEPS,
        LAST_BAD_STEP; read and reset by nonfinite_parameters)"""
        self.plan = _Plan(params, states, self.group_size, params[0].device, self.seeds, self.firsts)
        self.plan.nonfinite = self.nonfinite
        self.plan.master_bits = master_bits
        self.steps = [s["step"] for s in states]
        names = MOMENTS[
            : 3 if "max_exp_avg_sq" in states[0] or is_compressed(states[0], "max_exp_avg_sq") else 2
        ]
        extra = (MASTER_CORRECTION,) if master_bits in (32, 24) else ()
        self.flat = [
            s[key] for s in states for key in [k for n in names for k in _state_keys(n, fm, fv)] + list(extra)
        ]
        """the states flattened for the custom op (per parameter: each moment's codes, scales[,
        exponents] or float32 tensor, then the master correction where there is one)"""


def _state_keys(name: str, fm: MomentFormat | None, fv: MomentFormat | None) -> tuple[str, ...]:
    """A moment's state keys in the op's flattened order (exp_avg in format fm, the others in fv)."""
    return state_keys(name, fm if name == "exp_avg" else fv)


def prepare(
    group: dict,
    params: list,
    grads: list,
    states: list,
    formats: list,
    masters=None,
    seeds=None,
    firsts=None,
) -> list[Launch]:
    """The launches for local CUDA tensors `params` of one param group (their grads give the
    gradient dtypes), with their `states`, moment formats (decided by the caller from the global
    shapes), master-weight modes, rounding seeds and first elements (each local tensor's offset
    in its global tensor): one launch per (dtypes, formats, mode)."""
    masters = masters if masters is not None else [None] * len(params)
    seeds = seeds if seeds is not None else [0] * len(params)
    firsts = firsts if firsts is not None else [0] * len(params)
    by_key: dict[tuple, list[int]] = {}
    for i, (p, g, f, m) in enumerate(zip(params, grads, formats, masters, strict=True)):
        by_key.setdefault((p.dtype, g.dtype, p.device, f["exp_avg"], f["exp_avg_sq"], m), []).append(i)
    return [
        Launch(
            idx,
            [params[i] for i in idx],
            [grads[i] for i in idx],
            [states[i] for i in idx],
            fm,
            fv,
            group.get("group_size", DEFAULT_GROUP_SIZE),
            master,
            [seeds[i] for i in idx],
            [firsts[i] for i in idx],
        )
        for (_, _, _, fm, fv, master), idx in by_key.items()
    ]


def run(launches: list[Launch], group: dict, grads: list, grad_scale, found_inf) -> bool:
    """One step of every launch with this step's `grads` (in the order given to `prepare`).
    Returns False, having changed nothing, when the launches no longer fit (a parameter moved,
    a gradient's dtype changed): the caller prepares them again."""
    per_launch = []
    for launch in launches:
        gs = [grads[i] for i in launch.index]
        if any(g.dtype != launch.grad_dtype for g in gs) or any(
            p.data_ptr() != a for p, a in zip(launch.params, launch.addresses, strict=True)
        ):
            return False
        per_launch.append(gs)
    compiling = torch.compiler.is_compiling()
    for launch, gs in zip(launches, per_launch, strict=True):
        if compiling:  # torch.compile and fake tensors see the registered op
            lr = group["lr"]
            torch.ops.coatstate.fused_adamw_(
                launch.params,
                gs,
                launch.flat,
                launch.steps,
                launch.nonfinite,
                lr if isinstance(lr, torch.Tensor) else None,
                0.0 if isinstance(lr, torch.Tensor) else float(lr),
                float(group["betas"][0]),
                float(group["betas"][1]),
                float(group["eps"]),
                float(group["weight_decay"]),
                bool(group["amsgrad"]),
                bool(group["maximize"]),
                _format_spec(launch.fm),
                _format_spec(launch.fv),
                launch.group_size,
                grad_scale,
                found_inf,
                launch.master_bits or 0,
                launch.seeds,
                launch.firsts,
            )
        else:  # eager: straight to the kernel (the dispatcher would bump the version counter of
            # every mutated state tensor, a host cost per tensor: docs/performance.md)
            _execute(launch.plan, group, gs, launch.fm, launch.fv, launch.group_size, grad_scale, found_inf)
    return True


def _format_spec(f: MomentFormat | None) -> str:
    """A moment format as a custom-op string argument: 'e4m3:1:128' (format, expansion, group size) or ''."""
    return "" if f is None else f"{f.fmt.value}:{int(f.expand)}:{f.group_size}"


def _parse_spec(spec: str) -> MomentFormat | None:
    if not spec:
        return None
    fmt, expand, group_size = spec.split(":")
    return MomentFormat(parse_format(fmt), bool(int(expand)), int(group_size))


def _fused_adamw_impl(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[torch.Tensor],
    steps: list[torch.Tensor],
    nonfinite: torch.Tensor,
    lr_tensor: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    exp_avg_format: str,
    exp_avg_sq_format: str,
    group_size: int,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    master_bits: int = 0,
    seeds: list[int] | None = None,
    firsts: list[int] | None = None,
) -> None:
    """The fused CompressedAdamW step as a torch custom op (so torch.compile and fake tensors trace
    through it): params, the flattened moment tensors (per parameter: codes, scales[, exponents]
    per moment, or the float32 moment), the step counts and the non-finite counters are updated
    in place. All parameters share dtypes and formats."""
    fm, fv = _parse_spec(exp_avg_format), _parse_spec(exp_avg_sq_format)
    names = MOMENTS if amsgrad else MOMENTS[:2]
    keys = [key for name in names for key in _state_keys(name, fm, fv)]
    keys += [MASTER_CORRECTION] if master_bits in (32, 24) else []
    if len(states) != len(keys) * len(params) or len(steps) != len(params):
        raise ValueError(
            f"fused_adamw_: expected {len(keys)} state tensors ({', '.join(keys)}) and one step per "
            f"parameter; got {len(states)} states and {len(steps)} steps for {len(params)} parameters"
        )
    state_dicts = [
        {"step": step_t, **dict(zip(keys, states[i * len(keys) : (i + 1) * len(keys)], strict=True))}
        for i, step_t in enumerate(steps)
    ]
    group = {
        "lr": lr_tensor if lr_tensor is not None else lr,
        "betas": (beta1, beta2),
        "eps": eps,
        "weight_decay": weight_decay,
        "amsgrad": amsgrad,
        "maximize": maximize,
        "group_size": group_size,
    }
    # the plan for these addresses (a reallocated state, after a load, is a new plan)
    group_size = fm.group_size if fm is not None else group_size
    key = (tuple(t.data_ptr() for t in (*params, *states, *steps)), nonfinite.data_ptr(), group_size)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = _Plan(params, state_dicts, group_size, params[0].device, seeds, firsts)
        plan.nonfinite = nonfinite
        plan.master_bits = master_bits or None
    _execute(plan, group, grads, fm, fv, group_size, grad_scale, found_inf)


fused_adamw_ = torch.library.custom_op(
    "coatstate::fused_adamw_", _fused_adamw_impl, mutates_args=("params", "states", "steps", "nonfinite")
)


@fused_adamw_.register_fake
def _(
    params,
    grads,
    states,
    steps,
    nonfinite,
    lr_tensor,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    amsgrad,
    maximize,
    exp_avg_format,
    exp_avg_sq_format,
    group_size,
    grad_scale,
    found_inf,
    master_bits=0,
    seeds=None,
    firsts=None,
) -> None:
    return None


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 16
"""launch plans of the compiled path, by the addresses they were built for (one per launch; a
plan holds its tensors, so few are kept)"""


@torch.compiler.disable  # a launch, never traced (dynamo would trace Triton's interpreter on CPU)
def _execute(plan: _Plan, group: dict, grads: list, fm, fv, group_size: int, grad_scale, found_inf) -> None:
    """Launch the kernel for `plan` with this step's gradients and hyperparameters (no host sync)."""
    compressed = fm is not None
    device = plan.params[0].device
    grads = [
        g if g.is_contiguous() and not g.data_ptr() % 16 else g.clone(memory_format=torch.contiguous_format)
        for g in grads
    ]
    base, size = grads[0].data_ptr(), grads[0].element_size()
    table = plan.table.clone()
    table[:, int(G)] = torch.tensor([(g.data_ptr() - base) // size for g in grads], dtype=torch.int64)
    table = _to_device(table, device)

    torch._foreach_add_(plan.steps, 1.0)
    hyper, scalars = _scalars(group, plan.steps, device)
    inv_scale = None
    if grad_scale is not None:
        inv_scale = grad_scale.to(device).double().reciprocal().float()  # GradScaler.unscale_'s arithmetic
    if found_inf is not None:
        found_inf = found_inf.to(device)

    if plan.n_blocks:
        bases = plan.bases
        _adamw_kernel[(plan.n_blocks,)](
            bases[P],
            grads[0],
            bases[M_CODES].view(torch.uint8) if compressed else bases[M_CODES],
            bases[V_CODES].view(torch.uint8) if compressed else bases[V_CODES],
            (
                bases.get(X_CODES, bases[M_CODES]).view(torch.uint8)
                if compressed
                else bases.get(X_CODES, bases[M_CODES])
            ),
            bases.get(C, bases[P]),
            table,
            plan.meta,
            plan.blocks,
            hyper,
            scalars,
            found_inf if found_inf is not None else hyper,
            inv_scale if inv_scale is not None else hyper,
            plan.nonfinite,
            COMPRESSED=compressed,
            EVEN=plan.launch_even(fm, fv),
            AMSGRAD=bool(group["amsgrad"]),
            MAXIMIZE=bool(group["maximize"]),
            HAS_SCALE=inv_scale is not None,
            HAS_INF=found_inf is not None,
            GROUP=group_size,
            GPP=plan.gpp,
            MASTER=plan.master_bits or 0,
            **kernel.launch_options(),
            **plan.constants(fm, fv),
        )
    if found_inf is not None:
        torch._foreach_sub_(plan.steps, [found_inf.float()] * len(plan.steps))
