"""Issue #31, the examples: each docstring starts with the exact command and says how long it
takes and what it prints, --help shows the whole description, --save is checked before the
training it would otherwise follow, and --compile without --compress-activations is not warned
about a compression policy it does not use. (examples/hf_trainer.py: tests/integration/test_hf_trainer.py.)"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch

from coatstate import compress_activations
from coatstate.activations import KEEP_ALL, hooks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
import train_gpt  # noqa: E402


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_docstring_starts_with_the_command_and_says_time_and_output(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.splitlines()[0].startswith(f"python examples/{path.name}"), doc and doc[:100]
    head = " ".join(doc.split("\n\n")[1].split())  # the paragraph after the command
    assert re.search(r"takes about [\d.]+ ?(s|seconds|minutes?) on .*CPU", head) and "prints" in head, head


def test_help_shows_the_whole_description():
    """The description was the docstring's third line alone, cut off mid-sentence."""
    text = train_gpt.parser().format_help()
    assert train_gpt.__doc__.strip() in text


def _no_training(*args, **kwargs):
    raise AssertionError("train() ran although --save cannot be written")


def test_save_destination_is_checked_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(train_gpt, "train", _no_training)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(SystemExit, match="--save .*cannot write a file there"):
        train_gpt.main(["--steps", "1", "--save", str(not_a_dir / "ck.safetensors")])
    with pytest.raises(SystemExit, match="is a directory; give a file name"):
        train_gpt.main(["--steps", "1", "--save", str(tmp_path)])
    train_gpt.check_save_destination(str(tmp_path / "new" / "ck.safetensors"))  # a folder it makes
    assert [p.name for p in tmp_path.rglob("*")] == ["file", "new"]  # the probe is gone
    train_gpt.check_save_destination("memory://run/ck.safetensors")


def _compiled_step(model, **policy) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compress_activations(**policy):
            loss = model(torch.randn(512, 256)).square().mean()
        loss.backward()
    return [str(w.message) for w in caught if "compiled_fp32" in str(w.message)]


def test_keep_all_over_a_compiled_model_is_not_warned_about_fp32(monkeypatch):
    """train_gpt.py counts what autograd saves with compress_activations(**KEEP_ALL) on its first
    step; over --compile'd blocks that warned that float32 saves are kept (in the progress bar),
    though keeping them was asked for. A policy that compresses still hears it."""
    torch._dynamo.reset()
    model = torch.compile(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()), backend="aot_eager"
    )
    monkeypatch.setitem(hooks._WARNED, "compiled_fp32", False)
    assert _compiled_step(model, **KEEP_ALL) == []
    (message,) = _compiled_step(model)
    assert "compiled_fp32='bf16'" in message
