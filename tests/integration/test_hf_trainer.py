"""examples/hf_trainer.py: a transformers Trainer with CompressedAdamW saves and resumes exactly.

Skipped when transformers (the `hf` extra) is not installed. Bound: the resumed run's losses must
equal the uninterrupted run's exactly. The checkpoint's optimizer.pt holds the FP8 codes, scales
and exponents themselves and load_state_dict copies them without requantizing, so the FP8 error
bound that applies to a requantized state (one E4M3 step, 2**-3 relative, per moment) is not
needed here: any difference means resume lost or changed state.
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_trainer  # noqa: E402


def test_trainer_resume_gives_the_uninterrupted_losses(tmp_path):
    result = hf_trainer.main(
        [
            "--steps",
            "8",
            "--dim",
            "64",
            "--seq",
            "32",
            "--batch",
            "4",
            "--output-dir",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert sorted(result["resumed"]) == [5, 6, 7, 8], result["resumed"]
    mismatches = {
        s: (result["uninterrupted"][s], r)
        for s, r in result["resumed"].items()
        if r != result["uninterrupted"][s]
    }
    assert not mismatches, (
        f"resumed losses differ from the uninterrupted run (step: (uninterrupted, resumed)): {mismatches}"
    )

    saved = torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=True)
    keys = {k for s in saved["state"].values() for k in s}
    assert {"exp_avg_codes", "exp_avg_sq_codes", "exp_avg_scales"} <= keys, (
        f"Trainer's optimizer.pt should hold CompressedAdamW's FP8 states; keys: {sorted(keys)}"
    )


def test_odd_step_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match="even number"):
        hf_trainer.main(["--steps", "7", "--output-dir", str(tmp_path), "--quiet"])


def test_default_run_leaves_nothing_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """Without --output-dir the checkpoints go to a temporary directory, removed at the end (it
    was coatstate-hf-run/ in the working directory)."""
    monkeypatch.chdir(tmp_path)
    result = hf_trainer.main(["--steps", "2", "--dim", "32", "--seq", "16", "--batch", "2", "--quiet"])
    assert result["max_abs_diff"] == 0
    assert not Path(result["checkpoint"]).exists()
    assert list(tmp_path.iterdir()) == []
    assert "in a temporary directory, removed" in capsys.readouterr().out


def test_help_shows_the_whole_description():
    assert hf_trainer.__doc__.strip() in hf_trainer.parser().format_help()
