"""CompressedAdamW's defaults come from one table (formats/defaults.py), and every param group's
options are checked when the group is added, not at the first step."""

from __future__ import annotations

import inspect
import pydoc
import re

import pytest
import torch
from coatstate.formats import group as twin
from coatstate.formats.defaults import OPTIMIZER_DEFAULTS
from coatstate.formats.fp8 import FP8Format
from coatstate.formats.optimizer_state import MomentFormat
from coatstate.kernels import group as kernel_codec

from coatstate import CompressedAdamW
from coatstate.optim.moments import moment_formats


def _defaults(fn) -> dict:
    return {k: v.default for k, v in inspect.signature(fn).parameters.items() if v.default is not v.empty}


def test_every_default_is_the_tables():
    table = dict(OPTIMIZER_DEFAULTS)
    signature = _defaults(CompressedAdamW.__init__)
    assert {k: signature[k] for k in table} == table, "the constructor's defaults differ from the table"
    table = dict(table)
    # the expand options' "auto" follows the format: formats.defaults.EXPAND for an FP8 one
    assert table["exp_avg_expand"] == table["exp_avg_sq_expand"] == "auto"
    table["exp_avg_expand"] = table["exp_avg_sq_expand"] = twin.EXPAND
    first = MomentFormat(FP8Format(table["exp_avg_format"]), table["exp_avg_expand"], table["group_size"])
    assert MomentFormat() == first
    assert moment_formats({}, torch.Size((64, 64)))["exp_avg"] == first, "a group's fallbacks"
    assert moment_formats({}, torch.Size((64, 64)))["exp_avg_sq"] == MomentFormat(
        FP8Format(table["exp_avg_sq_format"]), table["exp_avg_sq_expand"], table["group_size"]
    )
    codec = {
        "group_size": table["group_size"],
        "fmt": table["exp_avg_format"],
        "expand": table["exp_avg_expand"],
    }
    for fn in (twin.quantize, kernel_codec.quantize):
        assert _defaults(fn) == codec, f"{fn.__module__}.quantize's defaults differ from the table"
    assert _defaults(twin.storage_bytes) == {"group_size": codec["group_size"], "expand": codec["expand"]}
    p = torch.nn.Parameter(torch.randn(64, 64))
    group = CompressedAdamW([p]).param_groups[0]
    assert {k: group[k] for k in table if k != "master_bits"} == {
        k: v for k, v in table.items() if k != "master_bits"
    }


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("exp_avg_format", "e9m9", "param group 1: exp_avg_format: unknown moment format"),
        ("exp_avg_sq_expand", "yes", "param group 1: exp_avg_sq_expand must be True or False"),
        ("min_numel", -1, "param group 1: min_numel must be an int >= 0"),
        ("group_size", 0, "param group 1: group_size must be an int >= 1"),
        ("master_seed", 1.5, "param group 1: master_seed must be an int"),
        ("compress", None, "param group 1: compress must be True or False"),
    ],
)
def test_a_bad_group_option_is_refused_when_the_group_is_added(option, value, message):
    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    opt = CompressedAdamW([a])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [b], option: value})
    assert len(opt.param_groups) == 1, "a refused group must leave the optimizer as it was"
    with pytest.raises(ValueError, match=message):
        CompressedAdamW([{"params": [a]}, {"params": [b], option: value}])


def test_a_group_format_is_stored_in_one_spelling():
    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    opt = CompressedAdamW([a])
    opt.add_param_group({"params": [b], "exp_avg_format": "E5M2", "exp_avg_sq_format": FP8Format.E5M2})
    assert opt.param_groups[1]["exp_avg_format"] == opt.param_groups[1]["exp_avg_sq_format"] == "e5m2"


def test_the_docstring_renders_in_help_with_a_runnable_example():
    text = pydoc.render_doc(CompressedAdamW, renderer=pydoc.plaintext)
    for section in ("Args:", "Returns:", "Raises:", "Example:"):
        assert section in text, f"help(CompressedAdamW) lacks {section}"
    doc = inspect.getdoc(CompressedAdamW)
    assert not re.search(r"\d+(\.\d+)?%|20\d\d-\d\d", doc), "measurements belong in docs/benchmarks.md"
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "CompressedAdamW docstring", "exec"), {})
