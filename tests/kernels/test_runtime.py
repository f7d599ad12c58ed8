"""kernels/runtime.py: the one answer to "can coatstate's Triton kernels run here?"."""

from __future__ import annotations

import torch
from coatstate.kernels import runtime


def test_cpu_tensors_use_triton_only_under_the_interpreter_when_asked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not runtime.triton_usable(torch.device("cpu"))
    assert not runtime.triton_usable("cpu", interpreter=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime.triton_usable("cpu", interpreter=True), "fused=True may run the interpreter"
    assert not runtime.triton_usable("cpu"), "an automatic choice never picks the interpreter"


def test_cuda_tensors_need_triton_driving_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_drives_cuda", lambda: False)
    assert not runtime.triton_usable("cuda:0"), "a CUDA device without a Triton CUDA driver"
    monkeypatch.setattr(runtime, "_drives_cuda", lambda: True)
    assert runtime.triton_usable(torch.device("cuda", 0))
    assert not runtime.triton_usable("meta")
