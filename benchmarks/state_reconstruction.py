"""What a moment format loses of real Adam moments (COAT's Table 1 measure, on our states).

reconstruction(opt, m_codecs, v_codecs) encodes each float32 moment of a trained
torch.optim.AdamW that CompressedAdamW would compress (matrices of at least MIN_NUMEL elements)
with each codec and decodes it: per moment the relative squared error, and for the update
m / (sqrt(v) + eps) under each (m, v) codec pair its mean and relative squared errors.
state_reconstruction(opt) is the FP8 case (E4M3 groups of 128, plain and expanded) that
parity_gpu.py records at the end of each AdamW run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from coatstate.formats import dequantize, quantize

MIN_NUMEL = 4096
Codec = Callable[[torch.Tensor], torch.Tensor]
"""A float32 tensor -> the float32 tensor its encoding decodes to."""


def fp8_codec(expand: bool, group_size: int = 128) -> Codec:
    return lambda x: dequantize(quantize(x, group_size=group_size, fmt="e4m3", expand=expand))


FP8 = {"plain": fp8_codec(False), "expand": fp8_codec(True)}


def _sums() -> dict:
    return {"err": 0.0, "ref": 0.0}


@torch.no_grad()
def reconstruction(
    opt: torch.optim.Optimizer, m_codecs: dict[str, Codec], v_codecs: dict[str, Codec], eps: float = 1e-8
) -> dict:
    """{"tensors", "elements", "moments": {"m"|"v": {codec: rel_sq_err}}, "update": {"m_codec/v_codec":
    {"mse", "rel_sq_err"}}} over the compressible moments of `opt` (a torch AdamW)."""
    codecs = {"m": m_codecs, "v": v_codecs}
    moments = {name: {c: _sums() for c in codecs[name]} for name in codecs}
    update = {f"{a}/{b}": _sums() for a in m_codecs for b in v_codecs}
    tensors = elements = 0
    for p, state in opt.state.items():
        if p.dim() < 2 or p.numel() < MIN_NUMEL or "exp_avg" not in state:
            continue
        exact = {"m": state["exp_avg"].float(), "v": state["exp_avg_sq"].float()}
        decoded = {(name, c): f(exact[name]) for name in codecs for c, f in codecs[name].items()}
        for (name, c), x in decoded.items():
            moments[name][c]["err"] += float((x.double() - exact[name].double()).square().sum())
            moments[name][c]["ref"] += float(exact[name].double().square().sum())
        u = exact["m"].double() / (exact["v"].double().sqrt() + eps)
        for key, acc in update.items():
            cm, cv = key.split("/")
            u_q = decoded["m", cm].double() / (decoded["v", cv].double().sqrt() + eps)
            acc["err"] += float((u_q - u).square().sum())
            acc["ref"] += float(u.square().sum())
        tensors, elements = tensors + 1, elements + p.numel()
    if not tensors:
        raise ValueError("the optimizer holds no moments of matrices to measure (has it stepped?)")
    rel = lambda acc: acc["err"] / acc["ref"] if acc["ref"] else 0.0
    return {
        "tensors": tensors,
        "elements": elements,
        "moments": {name: {c: rel(acc) for c, acc in by.items()} for name, by in moments.items()},
        "update": {k: {"mse": acc["err"] / elements, "rel_sq_err": rel(acc)} for k, acc in update.items()},
    }


def state_reconstruction(opt: torch.optim.Optimizer) -> dict:
    """reconstruction() with E4M3 groups of 128, plain and expanded, for both moments."""
    return {**reconstruction(opt, FP8, FP8), "format": "e4m3, groups of 128"}
