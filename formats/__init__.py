"""The FP8 group format: its data type, the pure-torch reference codec, the on-disk schema."""

from .fp8 import FP8Format, round_to_fp8_grid
from .group import (
    EXPONENT_DENOMINATOR,
    MAX_EXPONENT_CODE,
    MIN_EXPONENT_CODE,
    GroupQuantized,
    dequantize,
    dequantize_groups,
    error_bound,
    group_layout,
    quantize,
    quantize_groups,
    storage_bytes,
)

__all__ = [
    "EXPONENT_DENOMINATOR",
    "MAX_EXPONENT_CODE",
    "MIN_EXPONENT_CODE",
    "FP8Format",
    "GroupQuantized",
    "dequantize",
    "dequantize_groups",
    "error_bound",
    "group_layout",
    "quantize",
    "quantize_groups",
    "round_to_fp8_grid",
    "storage_bytes",
]
