"""What several benchmark scripts share, under public names (a script never imports another
script's private helpers): the `meta` block every result JSON starts with, the model-shape options,
the GPT-shaped parameter set of the optimizer and checkpoint benchmarks and median [min-max]
statistics. (What only the experiments share: experiments/helpers.py.)"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from coatstate.models import ModelConfig


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


# ------------------------------------------------------------------------------------ models
def add_shape_args(p, *, dim: int = 1024, batch_help: str = "sequences per step") -> None:
    """The GPU benchmarks' model-shape options (GPT-2-medium by default) and batch size."""
    for flag, default in (("layers", 24), ("dim", dim), ("heads", 16), ("seq", 1024), ("batch", 8)):
        p.add_argument(f"--{flag}", type=int, default=default, help=batch_help if flag == "batch" else None)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--loss-chunks", type=int, default=8)


def shape_config(args, **options) -> ModelConfig:
    """The coatstate.models config that add_shape_args' options describe, with `options`."""
    shape = {k: getattr(args, k) for k in ("vocab", "layers", "dim", "heads", "seq", "loss_chunks")}
    return ModelConfig(**shape, **options)


def param_count(model_class, cfg: ModelConfig) -> int:
    """Parameters of model_class(cfg), built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(cfg).parameters())


# ------------------------------------------------------------------------ GPT-shaped state
def gpt_shapes(vocab: int = 50304, d: int = 2048, layers: int = 24, scale: float = 1.0) -> list[tuple]:
    """Parameter shapes of a GPT (tied embedding, pre-norm blocks with 4x MLP); 1.31B at scale 1."""
    d = max(128, int(d * scale**0.5) // 128 * 128)
    layers = max(1, int(layers * scale**0.5))
    shapes = [(vocab, d), (1024, d)]
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # ln1, qkv, proj
    block += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln2, mlp
    for _ in range(layers):
        shapes += block
    return shapes + [(d,), (d,)]


# ------------------------------------------------------------------------------ statistics
def median_range(values: list[float]) -> dict:
    """{median, min, max, all} of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": list(values)}
