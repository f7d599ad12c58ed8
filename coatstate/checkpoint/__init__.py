"""Checkpoints: save/load/read over fsspec, the safetensors container, atomic writes, DCP reading."""

from coatstate.checkpoint.api import Checkpoint, load, read, read_header, read_state_dict, save
from coatstate.formats.schema import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "load", "read", "read_header", "read_state_dict", "save"]
