"""The compressed optimizers (AdamW, SGD, Lion, Muon), AdamW's host-offloaded form, their pure-torch
steps and state-dict conversion."""

from coatstate.optim.adamw import CompressedAdamW
from coatstate.optim.base import CompressedOptimizer
from coatstate.optim.lion import CompressedLion
from coatstate.optim.master_convert import join_master, split_master
from coatstate.optim.moments import optimizer_state_bytes
from coatstate.optim.muon import CompressedMuon
from coatstate.optim.offload import HostOffloadAdamW
from coatstate.optim.sgd import CompressedSGD
from coatstate.optim.state_dict import (
    compress_adamw_state_dict,
    compress_state_dict,
    to_adamw_state_dict,
    to_reference_state_dict,
)

__all__ = [
    "CompressedAdamW",
    "CompressedLion",
    "CompressedMuon",
    "CompressedOptimizer",
    "CompressedSGD",
    "HostOffloadAdamW",
    "compress_adamw_state_dict",
    "compress_state_dict",
    "join_master",
    "optimizer_state_bytes",
    "split_master",
    "to_adamw_state_dict",
    "to_reference_state_dict",
]
