"""What several benchmark scripts share, under public names (a script never imports another
script's private helpers): the `meta` block every result JSON starts with, the GPT-shaped
parameter set of the optimizer and checkpoint benchmarks and a CompressedAdamW stepped over it,
median [min-max] statistics, and the torchrun set-up of the FSDP2 scripts."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch


# ------------------------------------------------------------------------- result JSON header
def result_meta(args: Any = None, device: str | None = None) -> dict:
    """The `meta` block of a result JSON: date (UTC), machine, device, torch, CUDA, python, the
    1-minute load average, the command line and, given `args` (an argparse Namespace), its values.

    `device` defaults to `args.device`, else "cpu"; the machine is the GPU's name on CUDA, the
    CPU's model and core count otherwise. benchmarks/report_common.py's provenance() reads `date`
    and `machine` (and the load average, for CPU timings).
    """
    device = str(device or getattr(args, "device", None) or "cpu")
    if device.startswith("cuda") and torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{_cpu_model()}, {os.cpu_count()} CPU cores"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    if args is not None:
        meta["args"] = {k: _json_value(v) for k, v in vars(args).items()}
    return meta


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(value)


# ------------------------------------------------------------------------ GPT-shaped state
def gpt_shapes(vocab: int = 50304, d: int = 2048, layers: int = 24, scale: float = 1.0) -> list[tuple]:
    """Parameter shapes of a GPT (tied embedding, pre-norm blocks with 4x MLP); 1.31B at scale 1."""
    d = max(128, int(d * scale**0.5) // 128 * 128)
    layers = max(1, int(layers * scale**0.5))
    shapes = [(vocab, d), (1024, d)]
    block = [
        (d,),
        (d,),
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
    ]
    for _ in range(layers):
        shapes += block
    return shapes + [(d,), (d,)]


def stepped_optimizer(
    device: str, vocab: int, scale: float, mesh=None, with_model: bool = True
) -> tuple[torch.optim.Optimizer, dict, int]:
    """(CompressedAdamW over gpt_shapes after one step, the float32 weights as a model state dict
    ({} without `with_model`), the parameter count). With a device mesh each rank holds its dim-0
    shard of every tensor."""
    import coatstate

    gen = torch.Generator(device).manual_seed(0)  # drawn where it lives: 1.31B on a CPU is slow
    params = []
    for shape in gpt_shapes(vocab=vocab, scale=scale):
        t = torch.randn(shape, generator=gen, device=device) * 0.02
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            t = distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)  # no communication
        params.append(torch.nn.Parameter(t))
    opt = coatstate.CompressedAdamW(params, lr=1e-3, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad()
    model = {f"w{i}": p.detach() for i, p in enumerate(params)} if with_model else {}
    return opt, model, sum(p.numel() for p in params)


# ------------------------------------------------------------------------------ statistics
def median_range(values: list[float]) -> dict:
    """{median, min, max, all} of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": list(values)}


def fmt_median_range(s: dict, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    """'median [min-max]' of a median_range() dict, each value times `scale`."""
    return (
        f"{fmt.format(s['median'] * scale)} [{fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)}]"
    )


# ---------------------------------------------------------------------------- FSDP2 scripts
def torchrun_setup(smoke: bool):
    """(1-D device mesh over all ranks, this rank's device) under torchrun: NCCL on CUDA, or gloo
    on the CPU with `smoke`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + sys.argv[0])
    cuda = not smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --smoke for the CPU/gloo run")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return init_device_mesh(device.type, (dist.get_world_size(),)), device


def log_rank0(*msg) -> None:
    """print() on rank 0 only, flushed."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(*msg, flush=True)


def token_batch(cfg, batch: int, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of random tokens below cfg.vocab, cfg.seq long, different per step and rank."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
