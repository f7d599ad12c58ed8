import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run under Triton's CPU interpreter (small shapes only). It
    # must be set before any kernel module is imported, hence here.
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
