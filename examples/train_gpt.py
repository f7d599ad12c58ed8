"""python examples/train_gpt.py --optimizer compressed --compress-activations --steps 150

Trains a byte-level GPT on the Python standard library's own source (found on this machine, no
download) with CompressedAdamW (or torch AdamW) and, optionally, FP8 saved activations. Ends with
a table: loss, optimizer-state bytes, activation bytes held, step time. --save/--resume take any
fsspec URL (a path, file://, memory://, s3://) through coatstate.save / coatstate.load.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

import coatstate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from models import GPT, ModelConfig  # noqa: E402 - the shared model definitions


def stdlib_corpus(max_bytes: int = 8 * 2**20) -> torch.Tensor:
    """Bytes of the stdlib's .py files (site-packages skipped), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        yield x, y


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--optimizer", choices=["adamw", "compressed"], default="compressed")
    ap.add_argument("--compress-activations", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="URL to save optimizer + model to at the end")
    ap.add_argument("--resume", help="URL of a checkpoint written by --save")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cfg = ModelConfig(vocab=256, layers=args.layers, dim=args.dim, heads=max(1, args.dim // 64), seq=args.seq)
    model = GPT(cfg).to(device)
    if args.optimizer == "compressed":
        opt = coatstate.CompressedAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if args.resume:
        coatstate.load(opt, args.resume, model=model)
    data = stdlib_corpus()
    stream = batches(data, args.batch, args.seq, args.seed)

    losses, times, act_bytes = [], [], 0
    bar = tqdm(range(args.steps), desc=f"{args.optimizer}", disable=not sys.stderr.isatty() and "CI" in os.environ)
    for _ in bar:
        x, y = (t.to(device) for t in next(stream))
        t0 = time.perf_counter()
        if args.compress_activations:
            with coatstate.compress_activations() as ctx:
                loss = model(x, y)
            act_bytes = ctx.stats.activation_bytes_held
        else:
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if args.save:
        coatstate.save(opt, args.save, model=model)

    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                if isinstance(t, torch.Tensor) and k != "step")
    n_params = sum(p.numel() for p in model.parameters())
    tail = losses[-10:]
    result = dict(optimizer=args.optimizer, compress_activations=args.compress_activations, activation_bytes=act_bytes,
                  final_loss=sum(tail) / len(tail), state_bytes=state, params=n_params,
                  step_ms=1e3 * sorted(times)[len(times) // 2], losses=losses)
    print(f"\n{'optimizer':10s} {'act. FP8':8s} {'params':>9s} {'loss (last 10)':>14s} "
          f"{'state bytes':>12s} {'B/param':>8s} {'act. bytes held':>15s} {'step ms':>8s}")
    print(f"{args.optimizer:10s} {str(args.compress_activations):8s} {n_params:9d} {result['final_loss']:14.4f} "
          f"{state:12d} {state / n_params:8.3f} {act_bytes if args.compress_activations else 'n/a':>15} "
          f"{result['step_ms']:8.1f}")
    if args.save:
        print(f"saved to {args.save}")
    return result


if __name__ == "__main__":
    main()
