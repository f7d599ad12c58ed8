"""The offload row of a plan: HostOffloadAdamW's GPU memory, host memory and the traffic of a step.

With the states on the host (coatstate.optim.offload) the GPU holds the 16-bit weights, the
gradients in flight (as with gradient release: the largest parameter's) and the activations; the
host holds the compressed moments, the master correction, a copy of the weights and one gradient
buffer per parameter. A step moves every gradient down and every weight up over PCIe, and the
host step reads and writes the weight, correction and moments and reads the gradient in host
memory. Those bytes per step, divided by the step time a job aims for, are the bandwidth it needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from coatstate.planner.memory import GB, PARAM_BYTES, Plan, Variant, optimizer_bytes


@dataclasses.dataclass(frozen=True)
class OffloadRow:
    """Bytes of one HostOffloadAdamW job at the plan's micro-batch, on one GPU."""

    gpu: dict[str, int]
    """params, grads (in flight), activations, transient and peak on the GPU"""
    host: dict[str, int]
    """optimizer (moments), master (corrections), buffers (weight copies and gradient buffers), total"""
    pcie_bytes: int
    """per step: gradients device -> host plus weights host -> device"""
    host_memory_bytes: int
    """per step: what the host step reads and writes in host memory"""

    def bandwidth(self, step_seconds: float) -> dict[str, float]:
        """GB/s of PCIe and of host memory that a step of `step_seconds` needs."""
        return {
            "pcie_gb_s": self.pcie_bytes / GB / step_seconds,
            "host_memory_gb_s": self.host_memory_bytes / GB / step_seconds,
        }

    def line(self) -> str:
        """One line for `coatstate plan`'s output."""
        states = (self.host["optimizer"] + self.host["master"]) / GB
        return (
            f"offload (HostOffloadAdamW, docs/offload.md): GPU peak {self.gpu['peak'] / GB:.2f} GB; host "
            f"{self.host['total'] / GB:.2f} GB (states {states:.2f}, weight and gradient buffers "
            f"{self.host['buffers'] / GB:.2f}); a step moves {self.pcie_bytes / GB:.2f} GB over PCIe and "
            f"{self.host_memory_bytes / GB:.2f} GB through host memory (at a 1 s step: that many GB/s)"
        )


def offload_row(plan: Plan, variant: Variant | None = None) -> OffloadRow:
    """HostOffloadAdamW's bytes for `plan`'s model at its micro-batch and sequence, on one GPU.

    Args:
        plan (`Plan`): from coatstate.planner.plan; its first CompressedAdamW variant (or
            `variant`) gives the moment formats, master_bits and the activations.
        variant (`Variant`, *optional*): the CompressedAdamW variant whose states go to the host.

    Returns:
        `OffloadRow`: GPU and host bytes, and the bytes a step moves.

    Raises:
        ValueError: no CompressedAdamW variant in the plan and none given.

    Example:
        >>> row = offload_row(plan(resolve_model("llama-2-7b"), seq=2048, batch=1))
        >>> row.bandwidth(step_seconds=10.0)
    """
    if variant is None:
        variant = next((v for v in plan.variants if v.optimizer == "compressed"), None)
        if variant is None:
            raise ValueError("the plan has no CompressedAdamW variant; pass variant=")
    s = plan.setup
    pb = PARAM_BYTES[s["param_dtype"]]
    numel = sum(math.prod(x) for x in plan.shapes)
    released = dataclasses.replace(variant, gradient_release=True)  # gradients leave as they come
    on_gpu = plan.breakdown(released, s["batch"], 1, "none")
    gpu = {k: on_gpu[k] for k in ("params", "grads", "activations", "transient")}
    gpu["peak"] = sum(gpu.values())
    moments = optimizer_bytes(plan.shapes, "compressed", 1, plan._options(variant))
    master = numel * variant.master_bytes(s["param_dtype"], s["master_weights"])
    host = {"optimizer": moments, "master": master, "buffers": 2 * numel * pb}
    host["total"] = sum(host.values())
    # the host step: weight and correction read and written, gradient read, moments read and written
    host_memory = numel * (2 * pb + pb) + 2 * (moments + master)
    return OffloadRow(gpu, host, 2 * numel * pb, host_memory)


def offload_summary(plan: Plan) -> dict[str, Any] | None:
    """The offload row for --json (None when the plan has no CompressedAdamW variant)."""
    if not any(v.optimizer == "compressed" for v in plan.variants):
        return None
    row = offload_row(plan)
    return {
        "gpu": row.gpu,
        "host": row.host,
        "pcie_bytes": row.pcie_bytes,
        "host_memory_bytes": row.host_memory_bytes,
    }
