"""For a child process that a kill test SIGKILLs mid-save: `install(marker)` makes every
safetensors file the checkpoint code writes stop once half of its bytes are in the temporary file
(flushed), create `marker` and sleep, so the parent kills it at a known point.

A monkeypatch inside the child's own process: the library carries no test hook.
"""

from __future__ import annotations

import os
import time

from coatstate.checkpoint import container, storage


class _Halfway:
    """Wraps the temporary file; pauses once half of the file being written went through."""

    def __init__(self, f, size: dict, marker: str):
        self.f, self.size, self.marker, self.seen, self.fired = f, size, marker, 0, False

    def write(self, b) -> int:
        n = self.f.write(b) or len(memoryview(b))
        self.seen += n
        if not self.fired and self.seen * 2 >= self.size.get("total", 0):
            self.fired = True
            self.f.flush()
            with open(self.marker, "w") as m:
                m.write(str(os.getpid()))
            time.sleep(60)
        return n

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def install(marker: str) -> None:
    size: dict = {}
    write_safetensors, atomic_write = container.write_safetensors, storage.atomic_write

    def sized(f, tensors, metadata):  # (called inside atomic_write's write, before any byte)
        size["total"] = len(container.safetensors_header(tensors, metadata)) + sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
        return write_safetensors(f, tensors, metadata)

    def paused(url, write):
        return atomic_write(url, lambda f: write(_Halfway(f, size, marker)))

    container.write_safetensors, storage.atomic_write = sized, paused
