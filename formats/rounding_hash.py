"""The random bits of stochastic rounding: one counter-based hash shared by every path that rounds
at random (master_bits=16's bfloat16 rounding, the 4-bit second moment's rounding).

A hash of (seed, step, element offset), not a generator's stream: any element's bits can be
computed alone, so the pure-torch twin, the CPU step and the Triton kernel (kernels/adamw_fused.py
spells out the same arithmetic) give the same bits whatever the tiling, and a resumed run draws
the bits it would have drawn.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def hash32(seed: int, step: int, offsets: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """32 random bits (int64) per element offset: a murmur3-style hash of (seed, step, offset),
    spelled out in 32-bit wrapping arithmetic so that the kernel gets the same bits. `stream`
    keeps two uses of one (seed, step) independent (master rounding: 0)."""
    key = (seed * 0x9E3779B1 + step * 0x632BE5AB + stream) & _MASK32
    key = _mix32(torch.tensor(key, dtype=torch.int64))
    return _mix32(((offsets.to(torch.int64) * 0x85EBCA77) & _MASK32) ^ key)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer, wrapping."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)
