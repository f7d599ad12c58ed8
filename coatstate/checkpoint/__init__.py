"""Checkpoints: save/load/read over fsspec, the safetensors container, atomic writes, DCP reading."""

from coatstate.checkpoint.api import Checkpoint, load, read, read_header, read_state_dict, save
from coatstate.checkpoint.background import SaveHandle, wait_for_saves
from coatstate.formats.schema import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SaveHandle",
    "load",
    "read",
    "read_header",
    "read_state_dict",
    "save",
    "wait_for_saves",
]
