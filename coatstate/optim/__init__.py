"""CompressedAdamW (AdamW with FP8 moments), its pure-torch step and state-dict conversion."""

from coatstate.optim.adamw import CompressedAdamW
from coatstate.optim.master_convert import join_master, split_master
from coatstate.optim.moments import optimizer_state_bytes
from coatstate.optim.state_dict import compress_adamw_state_dict, to_adamw_state_dict

__all__ = [
    "CompressedAdamW",
    "compress_adamw_state_dict",
    "join_master",
    "optimizer_state_bytes",
    "split_master",
    "to_adamw_state_dict",
]
