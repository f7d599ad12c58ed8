"""Checkpoints: save/load/read over fsspec, the safetensors container, atomic writes, per-rank
saves on torch.distributed.checkpoint (per_rank.py) and DCP reading without unpickling."""

from coatstate.checkpoint.api import Checkpoint, load, read, read_header, read_state_dict, save
from coatstate.checkpoint.background import SaveHandle, wait_for_saves
from coatstate.checkpoint.per_rank import latest
from coatstate.formats.schema import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SaveHandle",
    "latest",
    "load",
    "read",
    "read_header",
    "read_state_dict",
    "save",
    "wait_for_saves",
]
