"""The moving parts of host-offloaded optimizer steps: copies between the device and the host on
side streams, and host work run in order on one worker thread.

HostOffloadAdamW (coatstate.optim.offload) decides WHAT moves and steps; this module only knows
HOW: a gradient leaves the device on the `d2h` stream as soon as backward has produced it, the
worker waits for that copy, runs the host step, and sends the updated weight back on the `h2d`
stream; `finish()` (called by opt.step()) waits for all of it, so the next forward reads updated
weights.

On CUDA the copies are asynchronous (pinned host buffers, events, `record_stream` so that the
caching allocator does not hand a freed gradient's memory to the next kernel while the copy still
reads it). Without CUDA the "device" tensors are CPU tensors: copies run at once, streams and
events are None, and the same worker thread and ordering run, so the CPU tests exercise the
scheduling that the GPU runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import torch


@dataclasses.dataclass
class Timings:
    """Where one iteration's offload time went (seconds; bytes moved each way)."""

    host_step_s: float = 0.0
    """worker time inside host steps (overlapped with backward where backward was still running)"""
    d2h_s: float = 0.0
    """device -> host copy time on the side stream (CUDA events; 0.0 without CUDA)"""
    h2d_s: float = 0.0
    """host -> device copy time on the side stream (CUDA events; 0.0 without CUDA)"""
    wait_s: float = 0.0
    """time opt.step() spent waiting for host steps and copies after backward returned"""
    d2h_bytes: int = 0
    h2d_bytes: int = 0


class HostArena:
    """Host tensors carved out of large buffers, page-locked when `pin`: only pinned memory copies
    asynchronously and at full PCIe speed. torch's pinned allocator rounds every allocation up to
    a power of two (a 90 MB weight takes 128 MB), so tensors are packed into chunks whose size is
    a power of two already; a tensor larger than a chunk gets its own allocation."""

    ALIGN = 64
    """bytes: every tensor starts on a cache line"""

    def __init__(self, pin: bool, chunk_bytes: int = 1 << 30) -> None:
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self.reserved = 0
        """bytes allocated so far (chunks and large tensors), the host memory this arena holds"""

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous host tensor with `t`'s shape and dtype."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.chunk_bytes // 4:  # would waste much of a chunk's tail: on its own
            self.reserved += nbytes
            return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        if self._chunk is None or self._used + nbytes > self.chunk_bytes:
            self._chunk = torch.empty(self.chunk_bytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            self._used = 0
            self.reserved += self.chunk_bytes
        start = self._used
        self._used = -(-(start + nbytes) // self.ALIGN) * self.ALIGN
        # set_ rather than a view: a view shares its base's version counter, and the optimizer
        # reads a weight's own counter to see writes from outside (coatstate.optim.external_writes)
        out = torch.empty(0, dtype=t.dtype)
        return out.set_(self._chunk.untyped_storage(), start // t.element_size(), t.shape)


class HostPipeline:
    """Ordered device -> host copies, host work on one worker thread, host -> device copies.

    Args:
        device (`torch.device`): where the model's parameters live. CUDA gets side streams,
            events and pinned buffers; any other device copies synchronously.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        # one worker: host steps run in the order backward produced the gradients, and each uses
        # every CPU core through torch's intra-op threads; a second worker would only contend
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="coatstate-offload")
        self._futures: list[concurrent.futures.Future] = []
        self._events: list[tuple] = []
        self.timings = Timings()

    # ---- device -> host ------------------------------------------------------------------
    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """Copy each (device source, host destination) pair; returns the event the host must wait
        for (None: the copies are already done). The sources may be freed by the caller at once."""
        nbytes = sum(src.numel() * src.element_size() for src, _ in pairs)
        self.timings.d2h_bytes += nbytes
        if not self.cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        # the side stream starts once the compute stream has produced the sources
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.d2h):
            start.record()
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.d2h)  # freed by the caller: not reused before the copy ends
            done.record()
        self._events.append(("d2h", start, done))
        return done

    # ---- host work ---------------------------------------------------------------------------
    def submit(self, ready: torch.cuda.Event | None, work: Callable[[], list[tuple]]) -> None:
        """Run `work` on the worker once `ready` has completed. `work` returns the (host source,
        device destination) pairs to copy back to the device after it."""
        self._futures.append(self._worker.submit(self._run, ready, work))

    def _run(self, ready, work) -> None:
        if ready is not None:
            ready.synchronize()  # waits on this thread only: backward goes on
        t0 = time.perf_counter()
        back = work()
        self.timings.host_step_s += time.perf_counter() - t0
        self._to_device(back)

    def _to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.timings.h2d_bytes += sum(src.numel() * src.element_size() for src, _ in pairs)
        if not self.cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):  # (a thread of its own)
            # a weight is written only after the kernels enqueued before its gradient's hook (the
            # last ones that read it in this backward) are done: d2h waited for them
            self.h2d.wait_stream(self.d2h)
            start.record()
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done.record()
        self._events.append(("h2d", start, done))

    # ---- the end of an iteration ---------------------------------------------------------------
    def finish(self) -> Timings:
        """Wait for every submitted step and copy; the compute stream then sees updated weights.
        Re-raises the first error of a host step. Returns this iteration's timings and resets them."""
        t0 = time.perf_counter()
        futures, self._futures = self._futures, []
        error = None
        for f in futures:  # all of them, even after an error: none may run on into the next step
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every step has ended
                error = error or e
        if self.cuda:
            # the host must not write a host weight (next step) that a copy still reads, and the
            # next forward must read the copied weights: wait for both streams here
            self.h2d.synchronize()
            self.d2h.synchronize()
            for kind, start, done in self._events:
                ms = start.elapsed_time(done) / 1e3
                if kind == "d2h":
                    self.timings.d2h_s += ms
                else:
                    self.timings.h2d_s += ms
        self._events.clear()
        timings, self.timings = self.timings, Timings()
        timings.wait_s = time.perf_counter() - t0
        if error is not None:
            raise error
        return timings

    def close(self) -> None:
        self._worker.shutdown(wait=True)
