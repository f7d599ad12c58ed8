"""The optimizer-state defaults: one table that every default is read from.

CompressedAdamW's signature, its param-group fallbacks (coatstate.optim.moments), MomentFormat
and the group codecs' keyword defaults (formats.group, kernels.group) all read these names, so
that a default changes here, once, and nowhere disagrees.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

GROUP_SIZE = 128
"""Elements per group of an optimizer moment along a row (COAT's choice)."""
MAX_GROUP_SIZE = 2**16
"""The largest group_size accepted anywhere (constructor, param groups, checkpoint headers, the
CLI): a group lies within one row, so a larger one only pads every row to its size (a header's
group_size of 2**40 made the first step allocate 562 TB); 65536 is wider than any model's rows."""
FORMAT = "e4m3"
"""FP8 format of both moments' codes (4-bit ones are opt-in: "e2m1" and "ue3m1_sqrt")."""
EXPAND = True
"""COAT's dynamic range expansion, for both moments and the codecs. On: training runs cannot tell
it from plain E4M3, and on real Adam moments it loses far less of the update m / sqrt(v)
(README, "Does it keep AdamW's accuracy?"). Flip this line to change the default."""

OPTIMIZER_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "compress": True,
        "group_size": GROUP_SIZE,
        "exp_avg_format": FORMAT,
        "exp_avg_sq_format": FORMAT,
        "exp_avg_expand": "auto",
        "exp_avg_sq_expand": "auto",
        "min_numel": 4096,
        "compress_1d": False,
        "master_bits": "auto",
        "master_seed": 0,
    }
)
"""CompressedAdamW's own param-group options (beside torch.optim.AdamW's) and their defaults.
min_numel: smaller tensors keep float32 moments (bitsandbytes' threshold); master_bits "auto"
is resolved per param group when it is added (24 for bfloat16 parameters); so are the expand
options' "auto": EXPAND for an FP8 format, False for a 4-bit one (which takes no expansion)."""
