"""Step times that hold on a noisy, shared host: interleaved rounds, paired ratios, GPU busy time.

A one-shot ratio of two step times measured minutes apart says as much about the host's
neighbours as about the code, so:
- every variant is warmed up once (compilation, CUDA-graph recording), then each round runs every
  variant for `steps` timed steps, the order rotated by one per round;
- a variant's round value is the median of its steps; its summary the median over rounds with the
  min-max spread (with 5 rounds the extremes are the data);
- a ratio of two variants is paired: the ratio within each round, then the median and min-max of
  those per-round ratios;
- one extra step per variant per round runs under torch.profiler, whose kernel intervals (merged:
  overlapping streams count once) give the GPU's busy time; busy / wall below HOST_BOUND marks a
  host-bound step.
Activation memory is read during warm-up (peak allocated minus allocated before the step): CUDA
graphs allocate while recording, and their replays allocate nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

HOST_BOUND = 0.9
"""GPU busy fraction (kernel time / wall time) below which a step is reported as host-bound."""


@dataclasses.dataclass
class Variant:
    """One way of running the training step. `step(i)` runs step i (input batch i mod n) and
    returns without synchronizing; `before_step` (if any) runs first, untimed (e.g. the CUDA-graph
    step marker)."""

    name: str
    step: Callable[[int], object]
    before_step: Callable[[], None] | None = None


@dataclasses.dataclass
class _Samples:
    wall: list[list[float]] = dataclasses.field(default_factory=list)  # per round, per step (ms)
    event: list[list[float]] = dataclasses.field(default_factory=list)
    host: list[list[float]] = dataclasses.field(default_factory=list)  # until step() returned
    kernel: list[float | None] = dataclasses.field(default_factory=list)  # per round (ms)
    peak_bytes: int | None = None
    allocated_before: int | None = None


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _run_step(v: Variant, i: int, cuda: bool) -> tuple[float, float, float | None]:
    """(wall ms, host ms until step returned, CUDA-event ms or None) of one synchronized step."""
    if v.before_step is not None:
        v.before_step()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    v.step(i)
    t1 = time.perf_counter()
    if cuda:
        end.record()
        end.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3, start.elapsed_time(end) if cuda else None


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals (in their unit), overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _kernel_ms(v: Variant, i: int) -> float | None:
    """GPU busy ms of one step, from the profiler's device events; None if it saw none."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if v.before_step is not None:
            v.before_step()
        v.step(i)
        torch.cuda.synchronize()
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    return busy_ms(spans) / 1e3 if spans else None


def _warm(v: Variant, s: _Samples, warmup: int, cuda: bool, first_index: int) -> None:
    """Warm-up steps; the peak over those after the first (compilation) is the step's memory."""
    for k in range(max(1, warmup)):
        measure = cuda and (k > 0 or warmup == 1)
        if measure:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if v.before_step is not None:
            v.before_step()
        v.step(first_index + k)
        _sync(cuda)
        if measure:
            peak = torch.cuda.max_memory_allocated() - before
            if s.peak_bytes is None or peak > s.peak_bytes:
                s.peak_bytes, s.allocated_before = peak, before


def run_rounds(
    variants: list[Variant],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    cuda: bool,
    profile: bool = True,
    on_round: Callable[[dict], None] | None = None,
    log: Callable[[str], None] = print,
    errors: dict | None = None,
) -> dict:
    """Warm every variant, then `rounds` interleaved rounds (module docstring); returns summary().
    A variant whose warm-up raises is left out of the rounds, its error put in `errors` if given
    (else raised)."""
    if cuda and profile:
        # kernels of CUDA graphs captured before the profiler's first use are not traced
        # (pytorch/pytorch#100441): initialise it before any variant records a graph
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()
    samples = {v.name: _Samples() for v in variants}
    warmed = []
    for v in variants:
        t0 = time.perf_counter()
        try:
            _warm(v, samples[v.name], warmup, cuda, 0)
        except Exception as e:  # (a peer that does not run here; the others are still measured)
            if errors is None:
                raise
            errors[v.name] = f"{type(e).__name__}: {e}"
            log(f"{v.name} FAILED in warm-up: {errors[v.name]}")
            continue
        warmed.append(v)
        log(f"warmed {v.name} in {time.perf_counter() - t0:.1f} s")
    variants = warmed
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            s = samples[v.name]
            times = [_run_step(v, r * steps + k, cuda) for k in range(steps)]
            s.wall.append([t[0] for t in times])
            s.host.append([t[1] for t in times])
            s.event.append([t[2] for t in times] if cuda else [])
            s.kernel.append(_kernel_ms(v, r) if cuda and profile else None)
        result = summary(samples, [v.name for v in variants])
        log(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {x['wall_ms']['median']:.1f}" for n, x in result.items())
        )
        if on_round is not None:
            on_round(result)
    return summary(samples, [v.name for v in variants])


def spread(values: list[float]) -> dict | None:
    """median, min and max of values (None where there are none)."""
    values = [x for x in values if x is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summary(samples: dict[str, _Samples], names: list[str]) -> dict:
    """Per variant: medians and min-max over rounds of the per-round medians, busy fraction."""
    out = {}
    for name in names:
        s = samples[name]
        wall = [statistics.median(w) for w in s.wall]
        row = {
            "rounds": len(wall),
            "steps_per_round": len(s.wall[0]) if s.wall else 0,
            "wall_ms": spread(wall),
            "host_ms": spread([statistics.median(h) for h in s.host]),
            "event_ms": spread([statistics.median(e) for e in s.event if e]),
            "kernel_ms": spread(s.kernel),
            "round_wall_ms": wall,
            "round_kernel_ms": s.kernel,
            "peak_bytes": s.peak_bytes,
            "allocated_before_bytes": s.allocated_before,
        }
        busy = [k / w for k, w in zip(s.kernel, wall, strict=False) if k is not None]
        row["busy"] = spread(busy)
        row["host_bound"] = None if not busy else statistics.median(busy) < HOST_BOUND
        out[name] = row
    return out


def paired(result: dict, name: str, base: str, key: str = "round_wall_ms") -> dict | None:
    """Per-round ratios name/base of `key` (round_wall_ms or round_kernel_ms): median, min, max."""
    a, b = result[name][key], result[base][key]
    ratios = [x / y for x, y in zip(a, b, strict=False) if x is not None and y]
    return spread(ratios)


def inductor_options(text: str) -> dict:
    """torch.compile options from a flag: 'a=1,b=0' -> {'a': True, 'b': False} (integers other than
    0/1 stay ints, other values strings)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        number = int(value) if value.lstrip("-").isdigit() else None
        out[key] = value if number is None else bool(number) if number in (0, 1) else number
    return out
