"""Bytes per GPU of a planned job: states from the library's own size rules, the plan's table.

Per GPU, for one variant, micro-batch B and N GPUs:
  params, grads   numel of rank 0's shard x bytes of the param dtype (FSDP2 splits dim 0 in
                  chunks of ceil(rows / N); rank 0 holds the largest)
  master          with bf16 params (none with master_weights=False): torch AdamW a float32 copy
                  (4 bytes per shard element), CompressedAdamW its master_bits correction (2, 1
                  or 0 bytes; "auto", its default, is 24 bits: 1 byte)
  (grads)         with gradient release, only the largest parameter's gradient
  optimizer       torch AdamW: fp32 m and v; CompressedAdamW: its moment_formats on the GLOBAL
                  shape and formats.group.storage_bytes of the shard
  activations     saved for backward (ActivationStats' accounting; for CompiledActivations the
                  bytes the compiled blocks hold), from the trace
  transient       the rest of the step's peak: autocast weight copies, logits and loss, gradients
                  of activations, unpacked activations in backward (from the trace), and with
                  FSDP2 the unsharded parameters of the root module plus three layers' worth of
                  unsharded parameters/gradients (current + prefetched layer, reduce-scatter input)
  peak            params + master + optimizer + the larger of
                    grads                                  (the end of backward: activations freed)
                    activations + transient + 1 gradient   (backward's peak, near its start)
                  Gradients and saved activations do not coexist: backward frees a layer's saved
                  tensors as it makes that layer's gradients, so all gradients exist only once
                  the activations are gone, and at backward's peak (the loss and the last layers)
                  only the first gradients do: one parameter's, the largest (a language model's
                  head, the first to get its gradient). Which of the two is larger depends on the
                  batch (docs/planner.md has the measured cases).
                  With grads_kept (zero_grad(set_to_none=False): gradients allocated through the
                  whole step) and no release, the sum.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from coatstate.formats.defaults import MOMENTUM_DEFAULTS
from coatstate.formats.fp4 import storage_bytes_fp4
from coatstate.formats.group import storage_bytes
from coatstate.formats.master_weights import CORRECTION_DTYPES, MASTER_BITS
from coatstate.optim.moments import FORMAT_DEFAULTS, moment_formats
from coatstate.planner.trace import ActivationModel

GB = 1e9
PARAM_BYTES = {"bf16": 2, "fp32": 4}
COLUMNS = ("params", "grads", "master", "optimizer", "activations", "transient")
MASTER_CORRECTION_BYTES = {
    b: CORRECTION_DTYPES[b].itemsize if b in CORRECTION_DTYPES else 0 for b in MASTER_BITS
}
"""Bytes per parameter of CompressedAdamW's master correction (formats.master_weights)."""
AUTO_MASTER_BITS = 24
"""What CompressedAdamW's master_bits="auto" resolves to for bfloat16 parameters."""


def local_shape(shape: tuple[int, ...], shards: int) -> tuple[int, ...]:
    """Rank 0's FSDP2 shard of a parameter (the largest: dim 0 in chunks of ceil(rows / shards))."""
    if shards <= 1 or not shape:
        return tuple(shape)
    return (math.ceil(shape[0] / shards), *shape[1:])


FOUR_BIT_OPTIONS = {"exp_avg_format": "e2m1", "exp_avg_sq_format": "ue3m1_sqrt"}
"""CompressedAdamW's options of a '4bit' Variant (expansion follows the format: off)."""


REFERENCE_MOMENTS = {"adamw": 2, "sgd": 1, "muon": 1, "lion": 1}
"""float32 moments per element of each torch reference (SGD with momentum; Lion's float32 form)"""
COMPRESSED_MOMENTS = {
    "compressed": ("exp_avg", "exp_avg_sq"),
    "compressed_sgd": ("momentum_buffer",),
    "compressed_muon": ("momentum_buffer",),
    "compressed_lion": ("exp_avg",),
}
"""the moments each compressed optimizer stores ("compressed": CompressedAdamW)"""


def optimizer_bytes(
    shapes: list[tuple[int, ...]], optimizer: str, shards: int = 1, options: dict[str, Any] | None = None
) -> int:
    """Optimizer state bytes on rank 0: a torch reference's fp32 moments ("adamw", "sgd" with
    momentum, "muon", "lion") or a compressed optimizer's ("compressed": CompressedAdamW,
    "compressed_sgd", "compressed_muon", "compressed_lion").

    The optimizer's own moment_formats decides from each GLOBAL shape what is compressed; a
    compressed moment takes formats.group.storage_bytes of the local shard. Step counters (4
    bytes per tensor) are left out, as CompressedAdamW.state_bytes() leaves them out.
    """
    if optimizer in REFERENCE_MOMENTS:
        return sum(4 * REFERENCE_MOMENTS[optimizer] * math.prod(local_shape(s, shards)) for s in shapes)
    if optimizer not in COMPRESSED_MOMENTS:
        known = sorted(REFERENCE_MOMENTS) + sorted(COMPRESSED_MOMENTS)
        raise ValueError(f"optimizer must be one of {known}; got {optimizer!r}")
    group = {**FORMAT_DEFAULTS, **MOMENTUM_DEFAULTS, **(options or {})}
    total = 0
    for s in shapes:
        local = local_shape(s, shards)
        formats = moment_formats(group, torch.Size(s), COMPRESSED_MOMENTS[optimizer])
        for name in COMPRESSED_MOMENTS[optimizer]:
            fmt = formats[name]
            if fmt is None:
                total += 4 * math.prod(local)
            elif fmt.bits == 4:
                total += storage_bytes_fp4(local, group_size=fmt.group_size)
            else:
                total += storage_bytes(local, group_size=fmt.group_size, expand=fmt.expand)
    return total


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to train the model."""

    name: str
    optimizer: str
    """'adamw' (torch, fp32 moments) or 'compressed' (CompressedAdamW)."""
    activations: str
    """Trace kind: 'none', 'compressed' (compress_activations), 'fp8' (+ FP8 linear layers) or
    'compiled' (FP8 linear layers in blocks compiled with CompiledActivations)."""
    master_bits: int | str | None = "auto"
    """CompressedAdamW's master_bits for bf16 parameters, with its meaning and default ("auto":
    24; None: no master); the master column holds its correction (2, 1 or 0 bytes per
    parameter). torch AdamW ('adamw') keeps a float32 copy (4 bytes) and takes only "auto"."""
    gradient_release: bool = False
    """Each parameter steps during backward and frees its gradient: the grads column holds the
    largest parameter's gradient, not all of them."""
    moments: str = "fp8"
    """CompressedAdamW's moment formats: 'fp8' (the plan's optimizer_options, by default the
    library's) or '4bit' (exp_avg e2m1, exp_avg_sq ue3m1_sqrt over those options)."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "compressed"):
            raise ValueError(f"optimizer must be 'adamw' or 'compressed'; got {self.optimizer!r}")
        if self.moments not in ("fp8", "4bit") or (self.moments == "4bit" and self.optimizer != "compressed"):
            raise ValueError(f"Variant {self.name!r}: moments must be 'fp8', or '4bit' with 'compressed'")
        allowed = ("auto",) if self.optimizer == "adamw" else ("auto", None, *MASTER_BITS)
        if self.master_bits not in allowed:
            raise ValueError(
                f"Variant {self.name!r}: master_bits must be one of {allowed} for optimizer "
                f"{self.optimizer!r}; got {self.master_bits!r}"
            )

    def master_bytes(self, param_dtype: str, master_weights: bool) -> int:
        """Bytes per parameter that stand for its float32 master weight."""
        if param_dtype == "fp32" or not master_weights:  # fp32 params are their own master
            return 0
        if self.optimizer == "adamw":
            return 4
        bits = AUTO_MASTER_BITS if self.master_bits == "auto" else self.master_bits
        return 0 if bits is None else MASTER_CORRECTION_BYTES[bits]


@dataclasses.dataclass(frozen=True)
class Row:
    variant: Variant
    bytes: dict[str, int]
    """COLUMNS -> bytes per GPU at the plan's micro-batch and GPU count, plus 'peak'."""
    fits: bool
    min_gpus: int | None
    """Fewest GPUs whose memory holds the job at the plan's micro-batch (FSDP2 when > 1)."""
    max_batch: int
    """Largest micro-batch that fits at the plan's GPU count and sharding (0: none)."""


@dataclasses.dataclass
class Plan:
    """What `coatstate plan` prints. Built by coatstate.planner.plan()."""

    model: str
    params: int
    layers: int
    setup: dict[str, Any]
    shapes: list[tuple[int, ...]]
    layer_numel: int
    """Parameters of the largest repeated layer (an FSDP2 unit)."""
    root_numel: int
    """Parameters outside the repeated layers (embeddings, final norm, head)."""
    variants: list[Variant]
    activations: dict[str, ActivationModel]
    optimizer_options: dict[str, Any]
    notes: list[str]
    rows: list[Row] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        s = self.setup
        self.rows = []
        for v in self.variants:
            b = self.breakdown(v, s["batch"], s["gpus"], s["sharding"])
            self.rows.append(Row(v, b, b["peak"] <= s["gpu_memory"], self.min_gpus(v), self.max_batch(v)))

    def breakdown(self, v: Variant, batch: int, gpus: int, sharding: str) -> dict[str, int]:
        """Bytes per GPU (rank 0) for variant v: COLUMNS and 'peak'."""
        s = self.setup
        n = gpus if sharding == "fsdp2" else 1
        pb = PARAM_BYTES[s["param_dtype"]]
        local = sum(math.prod(local_shape(x, n)) for x in self.shapes)
        act = self.activations[v.activations]
        saved, peak_act = act.saved(batch, s["seq"]), act.peak(batch, s["seq"])
        fsdp = 0
        if n > 1:  # unsharded root params stay for the step; a layer is gathered, prefetched, reduced
            fsdp = self.root_numel * pb - math.ceil(self.root_numel / n) * pb + 3 * self.layer_numel * pb
        largest = max((math.prod(local_shape(x, n)) for x in self.shapes), default=0)
        out = {
            "params": local * pb,
            "grads": (largest if v.gradient_release else local) * pb,
            "master": local * v.master_bytes(s["param_dtype"], s["master_weights"]),
            "optimizer": optimizer_bytes(self.shapes, v.optimizer, n, self._options(v)),
            "activations": saved,
            "transient": max(peak_act - saved, 0) + fsdp,  # the fitted peak can dip below the saved bytes
        }
        static = out["params"] + out["master"] + out["optimizer"]
        if s.get("grads_kept") and not v.gradient_release:  # zero_grad(set_to_none=False)
            out["peak"] = static + out["grads"] + out["activations"] + out["transient"]
            return out
        backward = largest * pb + out["activations"] + out["transient"]
        out["peak"] = static + max(out["grads"], backward)
        return out

    def _options(self, v: Variant) -> dict[str, Any]:
        if v.moments == "4bit":
            return {**self.optimizer_options, **FOUR_BIT_OPTIONS}
        return self.optimizer_options

    def _fits(self, v: Variant, batch: int, gpus: int, sharding: str) -> bool:
        return self.breakdown(v, batch, gpus, sharding)["peak"] <= self.setup["gpu_memory"]

    def min_gpus(self, v: Variant, limit: int = 4096) -> int | None:
        batch = self.setup["batch"]
        fits = lambda n: self._fits(v, batch, n, "fsdp2" if n > 1 else "none")  # noqa: E731
        if fits(1):
            return 1
        hi = 2
        while not fits(hi):
            if hi >= limit:
                return None
            hi *= 2
        lo = hi // 2  # lo does not fit, hi does: the per-GPU peak falls as GPUs are added
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi

    def max_batch(self, v: Variant, limit: int = 1 << 20) -> int:
        s = self.setup
        fits = lambda b: self._fits(v, b, s["gpus"], s["sharding"])  # noqa: E731
        if not fits(1):
            return 0
        lo, hi = 1, 2
        while fits(hi):
            if hi >= limit:
                return hi
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    # ---- output ----------------------------------------------------------------------------
    def describe(self) -> str:
        s = self.setup
        masters = (
            " with master weights (torch AdamW: an fp32 copy; CompressedAdamW: its master_bits "
            f"correction, {AUTO_MASTER_BITS} bits by default)"
        )
        prec = (
            "bf16 params and grads" + (masters if s["master_weights"] else ", no master weights")
            if s["param_dtype"] == "bf16"
            else "fp32 params and grads" + (" + bf16 autocast" if s["autocast"] else "")
        )
        shard = "FSDP2" if s["sharding"] == "fsdp2" and s["gpus"] > 1 else "no sharding"
        return (
            f"{self.model}: {self.params / 1e6:,.1f}M params, {self.layers} layers; seq {s['seq']}, "
            f"micro-batch {s['batch']}, {s['gpus']} GPU(s), {shard}, {s['gpu_memory'] / GB:.1f} GB per "
            f"GPU; {prec}"
        )

    def table(self) -> str:
        """The verdict line, the job, the table and its legend (coatstate.planner.report)."""
        from coatstate.planner.report import table

        return table(self)

    def to_dict(self) -> dict[str, Any]:
        from coatstate.planner.report import summary

        return {
            "model": self.model,
            "params": self.params,
            "layers": self.layers,
            "setup": self.setup,
            "rows": [
                {
                    "variant": r.variant.name,
                    "optimizer": r.variant.optimizer,
                    "activations": r.variant.activations,
                    "bytes": r.bytes,
                    "fits": r.fits,
                    "min_gpus": r.min_gpus,
                    "max_micro_batch": r.max_batch,
                }
                for r in self.rows
            ],
            "trace_points": [list(p) for p in next(iter(self.activations.values())).trace_points],
            "notes": self.notes,
            **summary(self),
        }
