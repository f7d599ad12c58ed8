"""What each FP8 moment format loses of real Adam moments (COAT's Table 1 measure, on our states).

state_reconstruction(opt) takes a torch.optim.AdamW after training (its exact float32 moments),
encodes every moment CompressedAdamW would compress (matrices of at least MIN_NUMEL elements) in
E4M3 groups of 128, with and without COAT's range expansion, decodes it and compares:

  m, v     relative squared error  sum((x' - x)^2) / sum(x^2), per moment and format
  update   m / (sqrt(v) + eps) with each (m format, v format) pair: mean squared error (the
           paper's Table 1 measure) and relative squared error against the exact update

Called by parity_gpu.py at the end of each AdamW run, so the formats are judged on the states
of the very runs whose losses the table reports.
"""

from __future__ import annotations

import torch
from coatstate.formats import dequantize, quantize

MIN_NUMEL = 4096
FORMATS = {"plain": False, "expand": True}


def _sums() -> dict:
    return {"err": 0.0, "ref": 0.0}


@torch.no_grad()
def state_reconstruction(opt: torch.optim.Optimizer, eps: float = 1e-8) -> dict:
    """{"tensors", "elements", "moments": {m|v: {fmt: rel_sq_err}}, "update": {"m_fmt/v_fmt":
    {"mse", "rel_sq_err"}}} over the compressible moments of `opt` (a torch AdamW)."""
    moments = {name: {f: _sums() for f in FORMATS} for name in ("m", "v")}
    update = {f"{a}/{b}": _sums() for a in FORMATS for b in FORMATS}
    tensors = elements = 0
    for p, state in opt.state.items():
        if p.dim() < 2 or p.numel() < MIN_NUMEL or "exp_avg" not in state:
            continue
        exact = {"m": state["exp_avg"].float(), "v": state["exp_avg_sq"].float()}
        decoded = {
            (name, f): dequantize(quantize(x, group_size=128, fmt="e4m3", expand=expand))
            for name, x in exact.items()
            for f, expand in FORMATS.items()
        }
        for (name, f), x in decoded.items():
            moments[name][f]["err"] += float((x.double() - exact[name].double()).square().sum())
            moments[name][f]["ref"] += float(exact[name].double().square().sum())
        u = exact["m"].double() / (exact["v"].double().sqrt() + eps)
        for key, acc in update.items():
            fm, fv = key.split("/")
            u_q = decoded["m", fm].double() / (decoded["v", fv].double().sqrt() + eps)
            acc["err"] += float((u_q - u).square().sum())
            acc["ref"] += float(u.square().sum())
        tensors, elements = tensors + 1, elements + p.numel()
    if not tensors:
        raise ValueError("the optimizer holds no moments of matrices to measure (has it stepped?)")
    rel = lambda acc: acc["err"] / acc["ref"] if acc["ref"] else 0.0
    return {
        "tensors": tensors,
        "elements": elements,
        "format": "e4m3, groups of 128",
        "moments": {name: {f: rel(acc) for f, acc in fmts.items()} for name, fmts in moments.items()},
        "update": {k: {"mse": acc["err"] / elements, "rel_sq_err": rel(acc)} for k, acc in update.items()},
    }
