"""DTensor support for CompressedAdamW states and coatstate checkpoints (FSDP2, DDP, DCP).

A parameter sharded on dim 0 (FSDP2's `fully_shard`) holds whole rows on each rank, and groups
never cross a row, so its compressed moment is stored as DTensors with the parameter's mesh and
placements: codes shaped like the parameter, scales/exponents shaped (rows, groups). Every rank
quantizes only its own rows: step() needs no collective, and DCP reshards codes and scales like
any other dim-0 sharded tensor. Placements other than Shard(0)/Replicate (tensor parallel's
Shard(1), say) would cut groups, so compressed moments refuse them.

Gathering (coatstate.save of a sharded optimizer) goes through uint8 views: gloo has no float8
all-gather ("Invalid scalar type"), and the bytes are all that has to move.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from coatstate.formats import group_layout


def is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view sharing its storage); any other tensor unchanged."""
    return t.to_local() if is_dtensor(t) else t


def local_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's state with every DTensor replaced by its local shard (same storage, so
    in-place updates of the result update the DTensors)."""
    return {k: local_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def check_compressible(p: torch.Tensor, name: str) -> None:
    """Raise unless the DTensor `p` can hold compressed moments (whole rows on every rank)."""
    from torch.distributed.tensor import Replicate, Shard

    bad = [
        pl
        for pl in p.placements
        if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0))
    ]
    if bad:
        raise ValueError(
            f"parameter {name} (global shape {tuple(p.shape)}) is a DTensor with placements {p.placements}: "
            "compressed moments need Shard(0) or Replicate (a group must not cross a shard); keep this "
            "parameter's moments in float32 with a param group with compress=False"
        )
    if p.ndim < 2 and any(isinstance(pl, Shard) for pl in p.placements):
        raise ValueError(
            f"parameter {name} is a 1-D DTensor sharded on dim 0: its single row of groups would be cut "
            "between ranks; use compress_1d=False (the default) so 1-D parameters keep float32 moments"
        )


def _global_shape(key: str, local: torch.Tensor, p: torch.Tensor) -> tuple[int, ...]:
    """The global shape of state tensor `key` (local shard `local`) of DTensor parameter `p`."""
    if key.endswith(("_scales", "_exponents")):  # (rows, groups): rows are cut like p's
        return (group_layout(p.shape, 1)[0], local.shape[1])
    if key.endswith("_codes") and local.dtype == torch.uint8:  # 4-bit: (rows, ceil(cols / 2)) bytes
        return (group_layout(p.shape, 1)[0], local.shape[1])
    return tuple(p.shape)  # FP8 codes and float32 moments are shaped like their parameter


def wrap_state(state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """Turn the plain local state tensors of DTensor parameter `p` into DTensors, in place.

    `step` stays a plain scalar tensor, as in torch.optim.AdamW under FSDP2. No collective:
    the global shape is given, so DTensor.from_local need not ask the other ranks.
    """
    from torch.distributed.tensor import DTensor

    for key, value in list(state.items()):
        if key == "step" or not isinstance(value, torch.Tensor) or is_dtensor(value):
            continue
        shape = _global_shape(key, value, p)
        stride = torch.empty(shape, device="meta").stride()
        state[key] = DTensor.from_local(
            value, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride
        )
    return state


def first_element(p: torch.Tensor) -> int:
    """The offset in the global tensor of the first element of p's local tensor: 0 for a plain
    tensor or a replicated DTensor, the shard's first row times the row's size for Shard(0) (the
    only sharding compressed states take: check_compressible). Keys stochastic rounding, so
    that a sharded run rounds each element as one process would."""
    if not is_dtensor(p) or p.ndim == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) * (p.numel() // max(p.shape[0], 1)) if offset else 0


def local_chunk(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, a gathered state tensor of DTensor parameter `p` (codes or
    moments shaped like p, or (rows, groups) scales), cut as p is cut. No collective."""
    from torch.distributed.tensor import distribute_tensor

    rows = group_layout(p.shape, 1)[0]
    if tuple(full.shape) != tuple(p.shape) and (full.ndim != 2 or full.shape[0] != rows):
        raise ValueError(
            f"a state tensor of shape {tuple(full.shape)} does not belong to a parameter of global shape "
            f"{tuple(p.shape)}"
        )
    if p.ndim < 2 and tuple(full.shape) != tuple(p.shape):
        return full  # (1, groups) scales of an unsharded 1-D parameter (check_compressible)
    dt = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return dt.to_local()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor on every rank (a collective); any other tensor unchanged."""
    if not is_dtensor(t):
        return t
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:  # float8: gloo cannot all-gather it
        from torch.distributed.tensor import DTensor

        raw = DTensor.from_local(
            t.to_local().view(torch.uint8),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
        return raw.full_tensor().view(t.dtype)
    return t.full_tensor()


def gather_state_dict(sd: Mapping[str, Any], *, cpu: bool = True) -> dict[str, Any]:
    """An optimizer state dict with every DTensor gathered to a full tensor (on every rank; a
    collective: every rank must call it, in the same order). Plain tensors pass through."""

    def full(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        v = full_tensor(v).detach()
        return v.cpu() if cpu else v

    state = {pid: {k: full(v) for k, v in s.items()} for pid, s in sd["state"].items()}
    return {"state": state, "param_groups": [dict(g) for g in sd["param_groups"]]}


def gather_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's state dict with DTensors (FSDP2 parameters) gathered, on the CPU (collective)."""
    return {k: full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}


def load_model_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy a full (gathered) model state dict into a model whose tensors may be DTensors: each
    rank copies its own part. The caller has checked the keys and shapes."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            src = full[name]
            if is_dtensor(t):
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(
                    src.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None
                ).to_local()
            local_tensor(t).copy_(src)


def has_dtensors(sd: Mapping[str, Any]) -> bool:
    return any(is_dtensor(v) for s in sd["state"].values() for v in s.values())


def is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a collective; `obj` itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_like_params(sd: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A full (gathered) state dict for a torch optimizer over DTensor parameters: every state
    tensor shaped like its parameter becomes a DTensor holding this rank's part (no collective).
    CompressedAdamW does this itself (it also cuts scales); plain optimizers need it here."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [pid for g in sd["param_groups"] for pid in g["params"]]
    if not any(is_dtensor(p) for p in params):
        return sd
    from torch.distributed.tensor import distribute_tensor

    state = dict(sd["state"])
    for pid, p in zip(ids, params, strict=False):
        if pid not in state or not is_dtensor(p):
            continue
        state[pid] = {
            k: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and tuple(v.shape) == tuple(p.shape)
            else v
            for k, v in state[pid].items()
        }
    return {**sd, "state": state}
