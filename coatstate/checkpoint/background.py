"""Asynchronous saves: `coatstate.save(..., blocking=False)` snapshots the state and returns; a
background thread writes, checksums and commits the file as a blocking save would.

The snapshot is the only part the training loop waits for: every tensor is copied once (CUDA
tensors into pinned host memory, queued on the current stream and waited for by the writer, CPU
tensors cloned), so the loop may change its parameters and states at once. At most one save is in
flight: the next save (or `SaveHandle.wait()`, or interpreter exit) waits for it, and a failure is
raised there, never dropped. At exit a save still running completes before the interpreter shuts
down; one that fails there is logged and the process exits with status 1.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours (see _register_exit)
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("coatstate")

_in_flight: list[SaveHandle] = []
_lock = threading.Lock()


class SaveHandle:
    """A save running in the background. `wait()` blocks until it is committed and raises what it
    raised; `done()` tells without blocking."""

    def __init__(self, url: str, write: Callable[[], None], ready: torch.cuda.Event | None) -> None:
        self.url = url
        self.error: BaseException | None = None
        self._ready = ready
        self._thread = threading.Thread(
            target=self._run, args=(write,), name=f"coatstate save {url}", daemon=True
        )
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            if self._ready is not None:
                self._ready.synchronize()  # the device-to-host copies of the snapshot
            write()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), which raises it
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        with _lock:
            if self in _in_flight:
                _in_flight.remove(self)
        if self.error is not None:
            error, self.error = self.error, None  # raised once
            raise RuntimeError(f"coatstate: the background save to {self.url} failed: {error}") from error


def wait_for_saves() -> None:
    """Wait for every background save of this process; raise the first failure."""
    with _lock:
        pending = list(_in_flight)
    for handle in pending:
        handle.wait()


def snapshot(obj: Any) -> tuple[Any, torch.cuda.Event | None]:
    """A copy of every tensor in `obj` (nested dicts, lists, tuples), on the CPU, and the CUDA event
    that marks the end of the device-to-host copies (None when nothing came from a GPU)."""
    copied_from_gpu = []

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                copied_from_gpu.append(t.device)
                return host
            return t.clone()
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    out = copy(obj)
    event = None
    if copied_from_gpu:
        event = torch.cuda.Event()
        event.record()
    return out, event


def start(url: str, write: Callable[[], None], ready: torch.cuda.Event | None) -> SaveHandle:
    """Run `write` in the background after the previous save (whose failure is raised here)."""
    wait_for_saves()
    handle = SaveHandle(url, write, ready)
    with _lock:
        _in_flight.append(handle)
    return handle


_failed_at_exit: list[BaseException] = []


def _wait_at_exit() -> None:
    try:
        wait_for_saves()
    except RuntimeError as e:
        logger.error("%s", e)
        _failed_at_exit.append(e)


def _exit_status() -> None:
    """A save that failed at exit fails the process: a job scheduler must not take it for done."""
    if _failed_at_exit:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing left to flush
                stream.flush()
        logging.shutdown()
        os._exit(1)


def _register_exit() -> None:
    """Wait for saves in flight before the interpreter shuts its thread pools down.

    threading's exit hooks run before atexit's, and concurrent.futures' hook makes every pool
    refuse new work ("cannot schedule new futures after interpreter shutdown"), which a save's
    hashing needs. threading runs its hooks in reverse order of registration, so ours (registered
    after concurrent.futures.thread was imported, above) runs first. atexit is the fallback where
    threading has no such hook.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(_wait_at_exit)
    else:
        register(_wait_at_exit)
    atexit.register(_exit_status)


_register_exit()
