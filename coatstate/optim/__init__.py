"""CompressedAdamW (AdamW with FP8 moments), its host-offloaded form, its pure-torch step and
state-dict conversion."""

from coatstate.optim.adamw import CompressedAdamW
from coatstate.optim.master_convert import join_master, split_master
from coatstate.optim.moments import optimizer_state_bytes
from coatstate.optim.offload import HostOffloadAdamW
from coatstate.optim.state_dict import compress_adamw_state_dict, to_adamw_state_dict

__all__ = [
    "CompressedAdamW",
    "HostOffloadAdamW",
    "compress_adamw_state_dict",
    "join_master",
    "optimizer_state_bytes",
    "split_master",
    "to_adamw_state_dict",
]
