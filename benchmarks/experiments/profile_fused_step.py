"""Profile target for Nsight Compute: a few CompressedAdamW steps on a GPT-shaped parameter set.

    ncu --kernel-name regex:_adamw_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/experiments/profile_fused_step.py --scale 0.25
"""

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from common import gpt_shapes  # noqa: E402

import coatstate  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--scale", type=float, default=0.25)
ap.add_argument("--expand", type=int, default=1)
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()
params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in gpt_shapes(scale=args.scale)]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = coatstate.CompressedAdamW(
    params, lr=1e-3, exp_avg_expand=bool(args.expand), exp_avg_sq_expand=bool(args.expand)
)
for _ in range(args.steps):
    opt.step()
torch.cuda.synchronize()
print("params", sum(p.numel() for p in params))
