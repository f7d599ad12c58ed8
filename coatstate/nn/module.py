"""FP8Linear: an nn.Linear whose three GEMMs run in FP8 and whose saved input is FP8 (COAT's linear).

The math, the backends and what is saved are described in coatstate.nn.functional.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from coatstate.distributed import is_dtensor
from coatstate.formats.fp8 import FLOAT_DTYPES
from coatstate.nn.config import FP8LinearConfig
from coatstate.nn.functional import ALIGN, FP8LinearFunction, has_fp8_cores

logger = logging.getLogger("coatstate")


def _shape_problem(in_features: int, out_features: int) -> str | None:
    if in_features % ALIGN or out_features % ALIGN:
        return (
            f"in_features={in_features} and out_features={out_features} must both be multiples of "
            f"{ALIGN} for torch._scaled_mm"
        )
    return None


class FP8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs and an FP8 saved input (see the module docstring).

    Same parameters, buffers and state-dict keys as nn.Linear, so checkpoints load into either.
    Master weights stay in whatever dtype the parameter has (the optimizer's precision); only
    the GEMM operands are FP8. `fallback_reason` is None while the FP8 path runs, else why not
    (a shape torch._scaled_mm cannot take runs in high precision, with one log line).

    Args:
        in_features, out_features, bias, device, dtype: as for nn.Linear.
        config (`FP8LinearConfig`, *optional*): how it computes; `FP8LinearConfig()` by default.

    Returns:
        `FP8Linear`; `FP8Linear.from_linear(linear, config)` turns an existing nn.Linear into one
        in place (`convert_to_fp8` does it for a whole model).

    Raises:
        TypeError: `config` is not an FP8LinearConfig.

    Example:
        >>> layer = coatstate.FP8Linear(4096, 4096, bias=False, config=coatstate.FP8LinearConfig())
        >>> y = layer(x)                   # x: (..., 4096), e.g. bfloat16 under autocast
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        config: FP8LinearConfig | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(config, log=True)

    def _setup_fp8(self, config: FP8LinearConfig | None, log: bool) -> None:
        config = config if config is not None else FP8LinearConfig()
        if not isinstance(config, FP8LinearConfig):
            raise TypeError(f"config must be an FP8LinearConfig; got {type(config).__name__}")
        self.fp8_config = config
        self.fallback_reason = _shape_problem(self.in_features, self.out_features)
        if log and self.fallback_reason:
            logger.warning("FP8Linear runs in high precision: %s", self.fallback_reason)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: FP8LinearConfig | None = None) -> FP8Linear:
        """Turn `linear` itself into an FP8Linear (in place: same object, parameters and hooks)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"from_linear takes an nn.Linear (exactly); got {type(linear).__name__}")
        linear.__class__ = cls
        linear._setup_fp8(config, log=True)
        return linear

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        logger.warning(
            "FP8Linear(%d -> %d) runs in high precision: %s", self.in_features, self.out_features, reason
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback_reason is None:
            if x.dtype not in FLOAT_DTYPES:
                self._fall_back(f"input dtype {x.dtype} (FP8 path takes float32, bfloat16, float16)")
            elif is_dtensor(self.weight):
                self._fall_back("the weight is a DTensor at forward time (tensor parallelism)")
        if self.fallback_reason is not None:
            return F.linear(x, self.weight, self.bias)
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        backend = self.fp8_config.backend
        scaled_mm = backend == "scaled_mm" or (backend == "auto" and has_fp8_cores(x.device))
        with torch.autocast(device, enabled=False):
            return FP8LinearFunction.apply(x, self.weight, self.bias, out_dtype, scaled_mm, self.fp8_config)

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        fp8 = f"backend={cfg.backend}, grad_fmt={cfg.grad_fmt.value}, fast_accum={cfg.fast_accum}"
        if self.fallback_reason:
            fp8 += f", HIGH PRECISION ({self.fallback_reason})"
        return f"{super().extra_repr()}, {fp8}"
