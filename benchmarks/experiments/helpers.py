"""What two or more experiments share and no kept benchmark uses: a CompressedAdamW stepped over
the GPT-shaped parameter set, median [min-max] formatting, interleaved A/B turns of optimizer
steps, the torchrun set-up of the FSDP2 scripts and loss-curve figures."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from common import gpt_shapes


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


def fmt_median_range(s: dict, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    """'median [min-max]' of a median_range() dict, each value times `scale`."""
    return (
        f"{fmt.format(s['median'] * scale)} [{fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)}]"
    )


def ab_arguments(doc: str) -> argparse.Namespace:
    """The CPU A/B experiments' options: --threads (counts to run at), --rounds, --out (JSON)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def optimizers_on_copies(labels, start: list, grads: list, **options) -> dict:
    """label -> a CompressedAdamW(**options) over its own copy of the `start` tensors, with `grads`
    as their gradients, stepped once (so that every variant's state exists before timing)."""
    import coatstate

    out = {}
    for label in labels:
        params = [torch.nn.Parameter(x.clone()) for x in start]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        out[label] = coatstate.CompressedAdamW(params, **options)
        out[label].step()
    return out


def interleaved_step_ms(
    optimizers: dict, use: Callable[[str], None], rounds: int, steps: int = 3
) -> dict[str, list[float]]:
    """Per variant (label -> optimizer), the median ms of `steps` steps in each of `rounds` turns,
    the variants taking turns in an order that alternates per round. `use(label)` switches the code
    path to that variant's before its turn (a patched function, say)."""
    ms = {label: [] for label in optimizers}
    for r in range(rounds):
        for label in list(optimizers) if r % 2 == 0 else list(optimizers)[::-1]:
            use(label)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                optimizers[label].step()
                times.append(time.perf_counter() - t)
            ms[label].append(1e3 * statistics.median(times))
    return ms


def ratio_range(base: list[float], new: list[float]) -> dict:
    """{median, min, max} of the per-round ratios new / base."""
    ratios = sorted(b / a for a, b in zip(base, new, strict=True))
    return dict(median=statistics.median(ratios), min=ratios[0], max=ratios[-1])


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


def _running_mean(xs: list[float], window: int = 20) -> list[float]:
    return [
        sum(xs[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))
    ]


def plot_loss_curves(ax, runs: dict[str, list[float]], labels: dict[str, str]) -> None:
    """Loss per step of each run (light) and its 20-step running mean, labelled."""
    for name, losses in runs.items():
        line = ax.plot(losses, alpha=0.25, linewidth=0.8)[0]
        ax.plot(_running_mean(losses), color=line.get_color(), linewidth=1.6, label=labels[name])
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.legend(fontsize=8)
    first = next(iter(runs.values()))[0]
    ax.set_ylim(top=min(ax.get_ylim()[1], first * 1.05))
