"""Plan a training job's memory per GPU, with and without coatstate's compression.

    from coatstate.planner import plan, resolve_model
    print(plan(resolve_model("config.json"), seq=2048, batch=2, gpus=4, sharding="fsdp2").table())

Per GPU, for torch AdamW, CompressedAdamW, CompressedAdamW + compress_activations, the same with
gradient release (and 4-bit moments), and FP8 linear layers + CompiledActivations (the FP8
recipe: its blocks compiled through inductor's partitioner, coatstate.planner.compiled_trace),
each with CompressedAdamW's defaults (master_bits=24 for bf16 params): parameters, gradients,
master weights and optimizer states from the model's real parameter shapes (on the meta device)
and the library's own rules (CompressedAdamW's moment_formats: group size, formats, expansion,
min_numel, 1-D params; formats.group.storage_bytes), FSDP2 shards as dim-0 chunks; activation
bytes and the step's transient peak from a short CPU trace of the model
(coatstate.planner.trace). The model then gives the peak per GPU, the fewest GPUs that fit and
the largest micro-batch that fits.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from coatstate.planner.memory import Plan, Row, Variant, optimizer_bytes
from coatstate.planner.models import (
    Shape,
    build_model,
    shape_for_params,
    shape_from_config,
    shape_from_numbers,
)
from coatstate.planner.report import first_paragraph
from coatstate.planner.trace import ActivationModel, Progress, find_layers, trace

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------ models
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model the planner can list the parameters of and trace."""

    name: str
    build: Callable[[int | None], nn.Module]
    """build(None): the full model on the meta device; build(k): k repeated layers (CPU or meta)."""
    layers: int
    hidden: int
    vocab: int
    max_seq: int | None
    """Longest sequence the model takes (None: unknown, --seq is required)."""


def _truncate(model: nn.Module, k: int) -> nn.Module:
    parent, attr, blocks = find_layers(model)
    setattr(parent, attr, nn.ModuleList(list(blocks)[:k]))
    return model


def spec_from_factory(factory: Callable[[], nn.Module], name: str | None = None) -> ModelSpec:
    """A model from a function that builds it (called under torch.device('meta'): no memory)."""

    def build(k: int | None) -> nn.Module:
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the factory returned {type(model).__name__}, not an nn.Module")
        return model if k is None else _truncate(model, k)

    full = build(None)
    _, _, blocks = find_layers(full)
    embeds = [m for m in full.modules() if isinstance(m, nn.Embedding)]
    if not embeds:
        raise ValueError("the model has no nn.Embedding: the planner feeds it token ids (B, S)")
    return ModelSpec(
        name or getattr(factory, "__qualname__", "model"),
        build,
        len(blocks),
        embeds[0].embedding_dim,
        embeds[0].num_embeddings,
        None,
    )


def spec_from_shape(shape: Shape, name: str) -> ModelSpec:
    def build(k: int | None) -> nn.Module:
        if k is None:
            with torch.device("meta"):
                return build_model(shape)
        return build_model(dataclasses.replace(shape, layers=k))

    return ModelSpec(name, build, shape.layers, shape.hidden, shape.vocab, shape.max_seq)


def _load_factory(text: str) -> Callable[[], nn.Module]:
    module_name, _, attr = text.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `coatstate plan mypkg.models:build` from a project root
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for {text!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {attr!r}: pass module:function")
    return factory


def resolve_model(
    model: Any = None,
    *,
    arch: str = "llama",
    params: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    max_seq: int = 2048,
    loss_chunks: int = 1,
) -> ModelSpec:
    """A ModelSpec from: a callable factory, a Shape, a config dict, a JSON config path,
    'module:factory', a transformers config name, or (model=None) plain numbers."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Shape):
        return spec_from_shape(model, f"{model.arch} shape")
    if isinstance(model, dict):
        return spec_from_shape(shape_from_config(model, loss_chunks=loss_chunks), "config")
    if callable(model):
        return spec_from_factory(model)
    if model is None:
        if params and not (layers or hidden) and not any((heads, kv_heads, ffn, vocab)):
            shape, name = shape_for_params(arch, params, max_seq=max_seq, loss_chunks=loss_chunks)
            return spec_from_shape(
                shape,
                f"{name}'s shape ({shape.layers} layers x {shape.hidden}), nearest to {params / 1e9:g}B",
            )
        if not (layers and hidden):
            missing = " and ".join(f"--{k}" for k, v in (("layers", layers), ("hidden", hidden)) if not v)
            raise ValueError(
                f"a model from numbers needs {missing} (or --params alone, which picks the published "
                "shape nearest to it)"
            )
        shape = shape_from_numbers(
            arch=arch,
            layers=layers,
            hidden=hidden,
            params=params,
            heads=heads,
            kv_heads=kv_heads,
            ffn=ffn,
            vocab=vocab,
            max_seq=max_seq,
            loss_chunks=loss_chunks,
        )
        return spec_from_shape(shape, f"{arch}: {layers} layers x {hidden}")
    text = str(model)
    if os.path.isfile(text):
        try:
            with open(text) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{text} is not a readable JSON config: {e}") from e
        return spec_from_shape(shape_from_config(cfg, loss_chunks=loss_chunks), os.path.basename(text))
    if ":" in text:
        return spec_from_factory(_load_factory(text), text)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(
            f"{text!r} is not a file or module:factory, and a config name needs transformers "
            "(pip install transformers), or save the config as JSON and pass its path"
        ) from None
    cfg = AutoConfig.from_pretrained(text).to_dict()
    return spec_from_shape(shape_from_config(cfg, loss_chunks=loss_chunks), text)


# --------------------------------------------------------------------------------- variants
def fp8_linear_converter() -> tuple[Callable[[nn.Module], nn.Module] | None, str]:
    """(convert, why): coatstate.nn.convert_to_fp8 over every nn.Linear but the vocabulary head
    (kept in high precision, as COAT does), or None and why not."""
    try:
        cnn = importlib.import_module("coatstate.nn")
    except ImportError:
        return None, "coatstate.nn is not there"
    convert_to_fp8 = getattr(cnn, "convert_to_fp8", None)
    if getattr(cnn, "FP8Linear", None) is None or not callable(convert_to_fp8):
        return None, "coatstate.nn has no FP8Linear/convert_to_fp8"

    def convert(model: nn.Module) -> nn.Module:
        vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=-1)
        return convert_to_fp8(model, filter_fn=lambda m, name: m.out_features != vocab)

    return convert, "coatstate.nn.convert_to_fp8"


def default_variants(param_dtype: str = "bf16") -> tuple[list[Variant], str]:
    """The ways of training `plan` compares, with CompressedAdamW's defaults (for bf16 params:
    master_bits=24), and why the FP8 linear one is left out ("" when it is in)."""
    variants = [
        Variant(f"torch AdamW + {param_dtype.upper()}", "adamw", "none"),
        Variant("CompressedAdamW", "compressed", "none"),
        Variant("CompressedAdamW + compress_activations", "compressed", "compressed"),
        Variant(
            "CompressedAdamW + compress_activations + gradient release",
            "compressed",
            "compressed",
            gradient_release=True,
        ),
        Variant(
            "CompressedAdamW + compress_activations + gradient release + 4-bit moments",
            "compressed",
            "compressed",
            gradient_release=True,
            moments="4bit",
        ),
    ]
    convert, why = fp8_linear_converter()
    if convert is not None:  # the FP8 recipe as it is trained for speed (benchmarks/one_gpu.py)
        name = "CompressedAdamW + FP8 linear + CompiledActivations"
        variants.append(Variant(name, "compressed", "compiled"))
    return variants, ("" if convert else f"FP8 linear variant left out: {why}")


# ----------------------------------------------------------------------------------- the plan


def _checked_setup(spec, seq, batch, gpus, sharding, gpu_memory, param_dtype) -> tuple[int | float, int]:
    """plan()'s arguments checked: (gpu_memory in bytes, the sequence length)."""
    if isinstance(gpu_memory, str):
        from coatstate.planner.units import parse_bytes

        gpu_memory = parse_bytes(gpu_memory)
    if param_dtype not in _DTYPES:
        raise ValueError(f"param_dtype must be 'bf16' or 'fp32'; got {param_dtype!r}")
    if sharding not in ("none", "fsdp2"):
        raise ValueError(f"sharding must be 'none' or 'fsdp2'; got {sharding!r}")
    for name, v in (("batch", batch), ("gpus", gpus)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    seq = seq or spec.max_seq
    if not seq:
        raise ValueError(f"{spec.name}: give the sequence length (--seq); the model does not say its maximum")
    if spec.max_seq and seq > spec.max_seq:
        raise ValueError(f"seq={seq} exceeds the model's maximum {spec.max_seq}: lower --seq")
    return gpu_memory, seq


def _parameter_shapes(spec: ModelSpec) -> tuple[list[tuple[int, ...]], int, int]:
    """(every parameter's shape, numel of the largest repeated layer, numel outside the layers)
    of the full model, built on the meta device."""
    full = spec.build(None)
    _, _, blocks = find_layers(full)
    block_ids = {id(p) for p in blocks.parameters()}
    named = list(full.named_parameters())
    shapes = [tuple(p.shape) for _, p in named]
    layer_numel = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    root_numel = sum(p.numel() for _, p in named if id(p) not in block_ids)
    return shapes, layer_numel, root_numel


def plan(
    model: Any,
    *,
    seq: int | None = None,
    batch: int = 1,
    gpus: int = 1,
    sharding: str = "none",
    gpu_memory: int | float | str = 80e9,
    param_dtype: str = "bf16",
    master_weights: bool | None = None,
    autocast: bool = True,
    variants: list[Variant] | None = None,
    optimizer_options: dict[str, Any] | None = None,
    trace_layers: int = 2,
    progress: bool = True,
    grads_kept: bool = False,
) -> Plan:
    """Memory per GPU for each variant; see the module docstring and docs/planner.md.

    param_dtype 'bf16': bf16 params and grads, fp32 master weights unless master_weights=False.
    param_dtype 'fp32': fp32 params and grads, bf16 autocast unless autocast=False.
    sharding 'fsdp2': params, grads, master weights and states are dim-0 sharded over `gpus`.
    progress: a line on stderr per stage once planning has taken longer than 2 seconds.
    grads_kept: the training loop keeps gradients allocated (zero_grad(set_to_none=False)), so
    they coexist with the saved activations; by default (torch's zero_grad) they do not.
    """
    spec = resolve_model(model)
    gpu_memory, seq = _checked_setup(spec, seq, batch, gpus, sharding, gpu_memory, param_dtype)
    master = param_dtype == "bf16" if master_weights is None else bool(master_weights)
    use_autocast = autocast and param_dtype == "fp32"
    notes = []
    if variants is None:
        variants, note = default_variants(param_dtype)
        notes += [note] if note else []

    kinds = {v.activations for v in variants}
    with Progress(enabled=progress) as report:
        report(f"listing the parameters of {spec.name}")
        shapes, layer_numel, root_numel = _parameter_shapes(spec)
        converter = fp8_linear_converter()[0] if {"fp8", "compiled"} & kinds else None
        run = lambda kinds: trace(  # noqa: E731
            spec.build,
            layers=spec.layers,
            seq=seq,
            hidden=spec.hidden,
            vocab=spec.vocab,
            autocast=use_autocast,
            dtype=_DTYPES[param_dtype],
            trace_layers=trace_layers,
            kinds=kinds,
            fp8_convert=converter,
            progress=report,
        )
        acts = run(kinds - {"compiled"})
        if "compiled" in kinds:
            try:  # a model's block that dynamo cannot compile must not cost the other rows
                acts |= run({"compiled"})
            except Exception as e:  # (dynamo, AOTAutograd and inductor raise many kinds)
                variants = [v for v in variants if v.activations != "compiled"]
                why = first_paragraph(str(e))
                notes.append(f"CompiledActivations rows left out: the blocks did not compile ({why})"[:300])
        if not variants and notes:
            raise ValueError(notes[-1])
    setup = dict(
        seq=seq,
        batch=batch,
        gpus=gpus,
        sharding=sharding,
        gpu_memory=int(gpu_memory),
        param_dtype=param_dtype,
        master_weights=master,
        autocast=use_autocast,
        grads_kept=bool(grads_kept),
    )
    return Plan(
        model=spec.name,
        params=sum(math.prod(s) for s in shapes),
        layers=spec.layers,
        setup=setup,
        shapes=shapes,
        layer_numel=layer_numel,
        root_numel=root_numel,
        variants=variants,
        activations=acts,
        optimizer_options=dict(optimizer_options or {}),
        notes=notes,
    )


__all__ = [
    "ActivationModel",
    "ModelSpec",
    "Plan",
    "Row",
    "Variant",
    "optimizer_bytes",
    "plan",
    "resolve_model",
]
