"""Reading torch.distributed.checkpoint directories (without torch.distributed, without pickle).

A DCP directory's .metadata is a pickle. It is read with an unpickler that builds only DCP's
own metadata dataclasses, torch.Size, dtypes, layouts and paths (anything else is refused), and
its tensors and small values with torch.load(weights_only=True): nothing runs code from the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


def _allowed_global(module: str, name: str) -> bool:
    import importlib
    import inspect

    if (module, name) in _DCP_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.distributed.checkpoint.metadata":
        obj = getattr(importlib.import_module(module), name, None)
        return inspect.isclass(obj) and obj.__module__ == module
    return False


def _read_dcp_metadata(stream, where: str) -> Any:
    import pickle

    from coatstate.formats.schema import CheckpointError

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _allowed_global(module, name):
                raise CheckpointError(
                    f"{where}: .metadata refers to {module}.{name}, which is not a checkpoint metadata type; "
                    "refusing to unpickle it"
                )
            return super().find_class(module, name)

    return _Restricted(stream).load()


def read_dcp(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None, dict[str, str]]:
    """(optimizer state dict with int param ids, model state dict or None, {param id: FQN}) from
    a torch.distributed.checkpoint directory written at any world size (tensors come back whole).

    The optimizer state dict is the entry of the saved mapping that has 'state' and
    'param_groups' (as get_state_dict makes it, keyed by parameter name); the model state dict
    is the entry named 'model', if any.
    """
    from coatstate.formats.schema import CheckpointError
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # the global .metadata only
            with open(meta, "rb") as f:
                metadata = _read_dcp_metadata(f, path)
            if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
                metadata.storage_meta.load_id = self.load_id
            return metadata

    class _Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:  # torch's unpickles with weights_only=False
            from torch.distributed.checkpoint._traverse import set_element

            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    from torch.distributed.checkpoint.api import CheckpointException

    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        raise CheckpointError(
            f"{path}: a directory without .metadata is not a torch.distributed.checkpoint (coatstate reads "
            "DCP directories, their .metadata pickle through a restricted unpickler)"
        )
    with open(meta, "rb") as f:
        _read_dcp_metadata(f, path)  # refuse a foreign pickle before DCP's reader (and its logging) sees it
    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=_Reader(path), planner=_Planner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot read the DCP checkpoint ({e!r})") from e
    if "state" in sd and "param_groups" in sd:
        osd = sd
    else:
        found = [v for v in sd.values() if isinstance(v, Mapping) and "state" in v and "param_groups" in v]
        if len(found) != 1:
            raise CheckpointError(
                f"{path}: expected one optimizer state dict (a mapping with 'state' and 'param_groups') in "
                f"the DCP checkpoint; found {len(found)} among its keys {sorted(sd)[:10]}"
            )
        osd = found[0]
    model = sd.get("model") if isinstance(sd.get("model"), Mapping) else None
    optimizer, names = _by_index(osd)
    return optimizer, (dict(model) if model is not None else None), names


def _by_index(osd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, str]]:
    """An optimizer state dict keyed by parameter name (get_state_dict's) -> torch's int ids."""
    names = [n for g in osd["param_groups"] for n in g["params"]]
    if all(isinstance(n, int) for n in names):
        return {"state": dict(osd["state"]), "param_groups": [dict(g) for g in osd["param_groups"]]}, {}
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    state = {index[n]: dict(s) for n, s in osd["state"].items()}
    return {"state": state, "param_groups": groups}, {i: str(n) for n, i in index.items()}
