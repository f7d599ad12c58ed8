"""Checkpoints: save/load/read over fsspec, the safetensors container, atomic writes, DCP reading,
removing what killed saves left (remove_unreferenced)."""

from coatstate.checkpoint.api import Checkpoint, load, read, read_header, read_state_dict, save
from coatstate.checkpoint.background import SaveHandle, wait_for_saves
from coatstate.checkpoint.rank_cleanup import remove_unreferenced
from coatstate.formats.schema import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SaveHandle",
    "load",
    "read",
    "read_header",
    "read_state_dict",
    "remove_unreferenced",
    "save",
    "wait_for_saves",
]
