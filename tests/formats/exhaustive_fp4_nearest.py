"""Exhaustive check (not collected by pytest: about a minute per codebook on 2 cores):

    python tests/formats/exhaustive_fp4_nearest.py e2m1
    python tests/formats/exhaustive_fp4_nearest.py ue3m1

For every float32 y from 0 up to a few ulps above the codebook's top level, the fused step's
encoder (kernels.fp4_triton._nearest: rounding in float32 bit arithmetic, run here by Triton's
interpreter in blocks of 2**20) gives the same code index as the twin (formats.fp4._nearest: the
midpoint search, ties to the even index, of y clamped to the top as encode_groups clamps it).
The encoder's y = |u| * (top / scale) with |u| <= scale stays below top * (1 + 2**-23).
Result on torch 2.13 / triton 3.9 (CPU): 0 mismatches for both, e2m1 also after its rounding
became one add of a power of two. The script exits 1 on any mismatch.
"""

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from coatstate.formats.fp4 import CODEBOOKS, _nearest  # noqa: E402
from coatstate.kernels.fp4_triton import E2M1, UE3M1_SQRT  # noqa: E402
from coatstate.kernels.fp4_triton import _nearest as kernel_nearest  # noqa: E402

BLOCK = 1 << 20


@triton.jit
def _codes(y_ptr, out_ptr, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, kernel_nearest(tl.load(y_ptr + offs), FMT))


def main(codebook: str) -> int:
    levels = torch.tensor(CODEBOOKS[codebook][0], dtype=torch.float32)
    top = levels[-1].item()
    fmt = {"e2m1": E2M1, "ue3m1": UE3M1_SQRT}[codebook]
    end = int(torch.tensor(top).view(torch.int32)) + 4  # up to 4 ulps above the top level
    bad, t0 = 0, time.time()
    for start in range(0, end, BLOCK * 16):
        n = min(BLOCK * 16, end - start)
        bits = torch.arange(start, start + n, dtype=torch.int32)
        y = torch.nn.functional.pad(bits, (0, -n % BLOCK)).view(torch.float32)
        got = torch.empty(y.shape, dtype=torch.int32)
        _codes[(y.numel() // BLOCK,)](y, got, fmt, BLOCK)
        want = _nearest(y[:n].clamp(max=top), levels)
        wrong = got[:n] != want
        if wrong.any():
            first = y[:n][wrong][:5].tolist()
            print(f"{codebook}: mismatches at {first}: kernel {got[:n][wrong][:5].tolist()}, "
                  f"twin {want[wrong][:5].tolist()}")  # fmt: skip
        bad += int(wrong.sum())
    took = time.time() - t0
    print(f"{codebook}: {bad} mismatches over the {end} float32 values in [0, top + 4 ulp], {took:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
