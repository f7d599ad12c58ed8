"""The rest of a run's state in the checkpoint: `save(..., extra={...})`.

A run resumes from more than its optimizer and model: the LR scheduler's state dict, the step,
the data position, RNG states. `extra` keeps them in the same file, so no second file has to be
kept in sync. Values are JSON (tagged as the param groups' are: tuples, non-finite floats,
dicts with int keys such as a MultiStepLR's milestones) and tensors, which are stored as
tensors under `extra/{n}` with checksums like every other; nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from coatstate.formats import schema


def flatten(extra: Mapping[str, Any], tensors: dict[str, torch.Tensor], prepare) -> dict[str, Any]:
    """The header's `extra` for `extra`; its tensors go into `tensors` (`prepare(tensor, where)`)."""
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise TypeError(
            f"extra must be a dict with str keys (e.g. {{'scheduler': sched.state_dict(), 'step': 100}}); "
            f"got {type(extra).__name__}"
        )

    count = [0]

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = schema.extra_key(count[0])
            count[0] += 1
            tensors[key] = prepare(value, where)
            return {"$tensor": key}
        if isinstance(value, tuple):
            return {"$tuple": [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            if any(k.startswith("$") for k in value):
                raise TypeError(f"{where}: dict keys starting with '$' are reserved; got {sorted(value)}")
            return {k: walk(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, Mapping):
            return {"$items": [[k, walk(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        return schema.encode_value(value, where)  # (raises TypeError naming what it cannot store)

    return {k: walk(v, f"extra.{k}") for k, v in extra.items()}


def check(encoded: Any, fail, ref) -> None:
    """The header's `extra`: an object of tagged JSON whose tensors are `extra/{n}` keys the
    header lists (`ref` records each as named). Walked without recursion."""
    if not isinstance(encoded, dict):
        fail("extra must be null or an object")
    stack: list[tuple[Any, str]] = [(encoded, "extra")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, dict):
            problem = schema.tag_problem(value)
            if problem:
                fail(f"{where}: {problem}")
            if "$tensor" in value:
                key = value["$tensor"]
                if not key.startswith(schema.EXTRA_PREFIX + "/"):
                    fail(f"{where} names tensor {key!r:.80}; extra may name only extra/ tensors")
                ref(key, key, where)
            elif "$tuple" in value or "$items" in value:
                stack.append((value.get("$tuple", value.get("$items")), where))
            elif "$float" not in value:
                stack.extend((v, f"{where}.{k}") for k, v in value.items())


def decode(encoded: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    return None if encoded is None else schema.decode_value(encoded, tensors)
