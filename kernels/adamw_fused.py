"""The fused, multi-tensor CompressedAdamW step in Triton.

One pass per element: read p, g and the moments' FP8 codes with their per-group scale (and
exponent), update in float32 registers exactly in torch.optim.AdamW's order, write p, the new
codes and the new per-group scales/exponents. One launch covers every parameter of a param group
that shares dtypes and formats: a table of addresses says where each tensor lives and a table of
blocks says which groups of which tensor each program takes. Nothing synchronises with the host:
lr, the step counts, GradScaler's scale and found_inf are read on the device.

Twin: kernels/adamw_twin.py (adamw_step_reference), the CPU path and the oracle.
Bytes moved per element with fp32 p and g: p 4+4, g 4, codes 1+1 per moment, scales ~5/128 per
moment: about 16.1 bytes, so the floor is numel * 16.1 / copy bandwidth.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..formats.fp8 import FP8Format
from ..formats.group import group_layout
from .adamw_twin import MomentFormat
from .fp8_triton import decode, encode, fp8_constants, from_fp8_bits, group_offsets, group_params, to_fp8_bits

# columns of the address table
P, G, M_CODES, M_SCALES, M_EXPS, V_CODES, V_SCALES, V_EXPS, X_CODES, X_SCALES, X_EXPS, STEP = range(12)
NPTR = 12
GROUPS_PER_PROGRAM = 8
NUM_WARPS = 4
DATA_COLUMNS = (P, G, M_CODES, V_CODES, X_CODES)
"""columns holding element offsets from the launch's base tensor; the others hold addresses"""


def usable(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on `device` (CUDA, or any device under TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and available()


@functools.cache
def available() -> bool:
    try:
        return torch.cuda.is_available() and triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception:  # noqa: BLE001 - no usable GPU driver: the pure-torch path runs
        return False


@triton.jit
def _data(base_ptr, row_ptr, COL: tl.constexpr, offs):
    """Pointers to a tensor's elements: a typed base pointer plus the tensor's element offset
    from it (a multiple of 16 bytes, so the compiler may use 16-byte vector loads)."""
    delta = tl.multiple_of(tl.load(row_ptr + COL), 128 // base_ptr.dtype.element_ty.primitive_bitwidth)
    return base_ptr + delta + offs


@triton.jit
def _load_moment(base_ptr, row_ptr, COL: tl.constexpr, offs, mask, gid, gmask, COMPRESSED: tl.constexpr,
                 EXPAND: tl.constexpr, IS_E4M3: tl.constexpr):
    if COMPRESSED:
        scales = tl.load(row_ptr + COL + 1).to(tl.pointer_type(tl.float32))
        q = from_fp8_bits(tl.load(_data(base_ptr, row_ptr, COL, offs), mask=mask, other=0), IS_E4M3)
        scale = tl.load(scales + gid, mask=gmask, other=0.0)
        if EXPAND:
            exps = tl.load(row_ptr + COL + 2).to(tl.pointer_type(tl.uint8))
            k16 = tl.load(exps + gid, mask=gmask, other=16).to(tl.float32)
        else:
            k16 = scale
        return decode(q, scale, k16, EXPAND)
    else:
        return tl.load(_data(base_ptr, row_ptr, COL, offs), mask=mask, other=0.0)


@triton.jit
def _store_moment(x, base_ptr, row_ptr, COL: tl.constexpr, offs, mask, gid, gmask, COMPRESSED: tl.constexpr,
                  EXPAND: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                  LOG2_MAX: tl.constexpr, K_NUMERATOR: tl.constexpr, IS_E4M3: tl.constexpr):
    if COMPRESSED:
        mag = tl.abs(x)
        a, k16, p0, p1 = group_params(mag, EXPAND, FP8_MAX, LOG2_MAX, K_NUMERATOR)
        y = encode(x, mag, p0, p1, EXPAND)
        scales = tl.load(row_ptr + COL + 1).to(tl.pointer_type(tl.float32))
        tl.store(_data(base_ptr, row_ptr, COL, offs), to_fp8_bits(y, FP8_MAX, MBITS, EMIN, IS_E4M3), mask=mask)
        tl.store(scales + gid, a, mask=gmask)
        if EXPAND:
            exps = tl.load(row_ptr + COL + 2).to(tl.pointer_type(tl.uint8))
            tl.store(exps + gid, k16.to(tl.uint8), mask=gmask)
    else:
        tl.store(_data(base_ptr, row_ptr, COL, offs), x, mask=mask)


@triton.jit
def _adamw_kernel(
    p_base, g_base, m_base, v_base, x_base, table_ptr, meta_ptr, blocks_ptr, hyper_ptr, scalars_ptr, found_inf_ptr, grad_scale_ptr, nonfinite_ptr,
    COMPRESSED: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
    GROUP: tl.constexpr, GPP: tl.constexpr, EVEN: tl.constexpr,
    M_EXPAND: tl.constexpr, M_MAX: tl.constexpr, M_MBITS: tl.constexpr, M_EMIN: tl.constexpr,
    M_LOG2_MAX: tl.constexpr, M_KNUM: tl.constexpr, M_E4M3: tl.constexpr,
    V_EXPAND: tl.constexpr, V_MAX: tl.constexpr, V_MBITS: tl.constexpr, V_EMIN: tl.constexpr,
    V_LOG2_MAX: tl.constexpr, V_KNUM: tl.constexpr, V_E4M3: tl.constexpr,
):
    if HAS_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
    local_block = tl.load(blocks_ptr + 2 * pid + 1)
    row_ptr = table_ptr + t * 12
    cols = tl.load(meta_ptr + 3 * t)
    groups_per_row = tl.load(meta_ptr + 3 * t + 1)
    n_groups = tl.load(meta_ptr + 3 * t + 2)

    gid = local_block.to(tl.int64) * GPP + tl.arange(0, GPP)
    gmask = gid < n_groups
    offs, mask = group_offsets(gid, n_groups, cols, groups_per_row, GROUP, EVEN)

    # per-launch hyperparameters and per-tensor step size / bias correction (see _scalars)
    decay = tl.load(hyper_ptr)
    w1 = tl.load(hyper_ptr + 1)
    b2 = tl.load(hyper_ptr + 2)
    w2 = tl.load(hyper_ptr + 3)
    eps = tl.load(hyper_ptr + 4)
    step_size = tl.load(scalars_ptr + 2 * t)
    inv_bc2_sqrt = tl.load(scalars_ptr + 2 * t + 1)

    p_ptrs = _data(p_base, row_ptr, 0, offs)
    p = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(_data(g_base, row_ptr, 1, offs), mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    m = _load_moment(m_base, row_ptr, 2, offs, mask, gid, gmask, COMPRESSED, M_EXPAND, M_E4M3)
    v = _load_moment(v_base, row_ptr, 5, offs, mask, gid, gmask, COMPRESSED, V_EXPAND, V_E4M3)

    p = p * decay
    if w1 < 0.5:  # torch.lerp's two formulas
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = v * b2 + w2 * g * g
    if AMSGRAD:
        vmax = _load_moment(x_base, row_ptr, 8, offs, mask, gid, gmask, COMPRESSED, V_EXPAND, V_E4M3)
        vmax = tl.maximum(vmax, v)
        denom = tl.sqrt(vmax) * inv_bc2_sqrt + eps
    else:
        denom = tl.sqrt(v) * inv_bc2_sqrt + eps
    p = p - step_size * tl.math.fdiv(m, denom)  # approximate division (div.full): 2 ulp

    tl.store(p_ptrs, p.to(p_base.dtype.element_ty), mask=mask)
    _store_moment(m, m_base, row_ptr, 2, offs, mask, gid, gmask, COMPRESSED, M_EXPAND, M_MAX, M_MBITS, M_EMIN,
                  M_LOG2_MAX, M_KNUM, M_E4M3)
    _store_moment(v, v_base, row_ptr, 5, offs, mask, gid, gmask, COMPRESSED, V_EXPAND, V_MAX, V_MBITS, V_EMIN,
                  V_LOG2_MAX, V_KNUM, V_E4M3)
    if AMSGRAD:
        _store_moment(vmax, x_base, row_ptr, 8, offs, mask, gid, gmask, COMPRESSED, V_EXPAND, V_MAX, V_MBITS,
                      V_EMIN, V_LOG2_MAX, V_KNUM, V_E4M3)
    # count non-finite moments (a NaN/Inf gradient): reported by CompressedAdamW, never hidden
    s = m + v
    bad = tl.sum(tl.sum(((s - s) != 0).to(tl.int32), axis=1), axis=0)
    if bad > 0:
        tl.atomic_add(nonfinite_ptr + t, bad)


def _constants(prefix: str, f: MomentFormat | None) -> dict:
    fmt = f.fmt if f is not None else FP8Format.E4M3
    c = fp8_constants(fmt)
    return {
        f"{prefix}_EXPAND": bool(f is not None and f.expand), f"{prefix}_MAX": c["FP8_MAX"],
        f"{prefix}_MBITS": c["MBITS"], f"{prefix}_EMIN": c["EMIN"], f"{prefix}_LOG2_MAX": c["LOG2_MAX"],
        f"{prefix}_KNUM": c["K_NUMERATOR"], f"{prefix}_E4M3": c["IS_E4M3"],
    }


class _Plan:
    """Everything about a launch that stays fixed from step to step (rebuilt when params/states change)."""

    def __init__(self, params, states, group_size, device):
        self.key = _plan_key(params, states)
        self.gpp = GROUPS_PER_PROGRAM
        n = len(params)
        table = torch.zeros((n, NPTR), dtype=torch.int64)
        self.bases = {P: params[0]}
        meta = torch.zeros((n, 3), dtype=torch.int64)
        blocks = []
        for i, (p, s) in enumerate(zip(params, states)):
            table[i, P] = _offset(p, self.bases[P])
            for col, name in ((M_CODES, "exp_avg"), (V_CODES, "exp_avg_sq"), (X_CODES, "max_exp_avg_sq")):
                data = s.get(f"{name}_codes", s.get(name))
                if data is None:
                    continue
                self.bases.setdefault(col, data)
                table[i, col] = _offset(data, self.bases[col])
                if f"{name}_codes" in s:
                    table[i, col + 1] = s[f"{name}_scales"].data_ptr()
                    if f"{name}_exponents" in s:
                        table[i, col + 2] = s[f"{name}_exponents"].data_ptr()
            table[i, STEP] = s["step"].data_ptr()
            rows, cols, gpr = group_layout(p.shape, group_size)
            n_groups = rows * gpr if p.numel() else 0
            meta[i] = torch.tensor([cols, gpr, n_groups])
            nb = triton.cdiv(n_groups, self.gpp)
            blocks.append(torch.stack([torch.full((nb,), i, dtype=torch.int32), torch.arange(nb, dtype=torch.int32)], 1))
        self.table = table
        self.meta = meta.to(device)
        self.blocks = torch.cat(blocks).to(device)
        self.n_blocks = self.blocks.shape[0]
        self.even = all(int(m[0]) % group_size == 0 for m in meta)
        self.steps = [s["step"] for s in states]
        self.params = list(params)
        self.nonfinite = torch.zeros(n, dtype=torch.int32, device=device)
        """per tensor: how many moment values came out NaN/Inf (counted on the device)"""


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
    scalars = torch.stack([lr / bias_correction1, bias_correction2.rsqrt()], 1).float()
    rest = _to_device(torch.tensor([1 - beta1, beta2, 1 - beta2, group["eps"]], dtype=torch.float32), device)
    if isinstance(lr, float):
        decay = _to_device(torch.tensor([1 - lr * group["weight_decay"]], dtype=torch.float32), device)
    else:
        decay = (1 - lr * group["weight_decay"]).reshape(1).float()
    hyper = torch.cat([decay, rest])
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


def _plan_key(params, states) -> tuple:
    return tuple((p.data_ptr(), s["step"].data_ptr()) for p, s in zip(params, states))


def step(cache: dict, group: dict, params: list, grads: list, states: list, formats: list,
         grad_scale, found_inf) -> None:
    """One fused step over local CUDA tensors `params`/`grads` of one param group, with their
    `states` and moment formats (decided by the caller from the global shapes). `cache` keeps
    the launch plans between steps."""
    launches: dict[tuple, list[int]] = {}
    for i, (p, g, f) in enumerate(zip(params, grads, formats)):
        launches.setdefault((p.dtype, g.dtype, p.device, f["exp_avg"], f["exp_avg_sq"]), []).append(i)
    for (p_dtype, g_dtype, device, fm, fv), idx in launches.items():
        _launch(cache, group, [params[i] for i in idx], [grads[i] for i in idx], [states[i] for i in idx],
                fm, fv, p_dtype, g_dtype, device, grad_scale, found_inf)


def _launch(cache, group, params, grads, states, fm, fv, p_dtype, g_dtype, device, grad_scale, found_inf):
    compressed = fm is not None
    group_size = fm.group_size if compressed else group.get("group_size", 128)
    if group_size & (group_size - 1):
        raise ValueError(f"the fused step needs a power-of-two group_size; got {group_size} (use fused=False)")
    ckey = (id(group), p_dtype, g_dtype, fm, fv)
    plan = cache.get(ckey)
    if plan is None or plan.key != _plan_key(params, states):
        plan = cache[ckey] = _Plan(params, states, group_size, device)
    grads = [g if g.is_contiguous() and g.data_ptr() % 16 == 0 else g.clone(memory_format=torch.contiguous_format)
             for g in grads]
    table = plan.table.clone()
    table[:, G] = torch.tensor([_offset(g, grads[0]) for g in grads], dtype=torch.int64)
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
            bases[P], grads[0], bases[M_CODES].view(torch.uint8) if compressed else bases[M_CODES],
            bases[V_CODES].view(torch.uint8) if compressed else bases[V_CODES],
            (bases.get(X_CODES, bases[M_CODES]).view(torch.uint8) if compressed else bases.get(X_CODES, bases[M_CODES])),
            table, plan.meta, plan.blocks, hyper, scalars,
            found_inf if found_inf is not None else hyper, inv_scale if inv_scale is not None else hyper,
            plan.nonfinite,
            COMPRESSED=compressed, EVEN=plan.even,
            AMSGRAD=bool(group["amsgrad"]), MAXIMIZE=bool(group["maximize"]),
            HAS_SCALE=inv_scale is not None, HAS_INF=found_inf is not None,
            GROUP=group_size, GPP=plan.gpp, num_warps=NUM_WARPS,
            **_constants("M", fm), **_constants("V", fv),
        )
    if found_inf is not None:
        torch._foreach_sub_(plan.steps, [found_inf.float()] * len(plan.steps))
