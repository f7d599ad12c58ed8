"""Whether coatstate's Triton kernels can run here: the one answer every caller uses.

The optimizer's fused step, the codec ops, the activation hooks and FP8Linear's operand casts
all ask this before launching a kernel, so a machine where Triton cannot drive the GPU (no
driver, a CPU-only or ROCm build of triton) falls back to the pure-torch twins everywhere alike.
Importing this module imports neither triton nor anything that touches a GPU.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is switched on (TRITON_INTERPRET=1: tests run kernels on CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _drives_cuda() -> bool:
    # cached: the answer cannot change within a process, and callers ask it once per tensor
    if not torch.cuda.is_available():
        return False
    try:
        import triton

        return triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception:  # noqa: BLE001 - triton missing or no usable driver: the pure-torch twins run
        return False


def triton_usable(device: torch.device | str, *, interpreter: bool = False) -> bool:
    """Whether coatstate's Triton kernels can run on tensors on `device`.

    Args:
        device: where the tensors live.
        interpreter: also answer True on any device when Triton's CPU interpreter is on
            (TRITON_INTERPRET=1); for explicit requests such as `fused=True`, never for automatic
            choices, which would otherwise run the slow interpreter in place of the torch twin.

    Returns:
        True for a CUDA device on which Triton drives CUDA (or, with `interpreter`, under the
        interpreter); False otherwise, without importing triton for a non-CUDA device.
    """
    if interpreter and interpreting():
        return True
    device = torch.device(device)
    return device.type == "cuda" and _drives_cuda()
