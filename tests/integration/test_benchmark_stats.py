"""The seed statistics behind the README's accuracy verdicts (benchmarks/report_common.py,
benchmarks/report.py), against numbers worked out by hand."""

import pytest
from report import _verdict  # noqa: E402
from report_common import pooled_noise, variant_summary, welch_interval_pct  # noqa: E402


def _data(losses: dict[str, list[float]]) -> dict:
    runs = {}
    for variant, xs in losses.items():
        for seed, x in enumerate(xs):
            runs[f"{variant}:{seed}"] = {
                "variant": variant, "seed": seed, "status": "done", "final_val_loss": x,
                "peak_gib": 1.0, "tokens_per_s": 1.0,
            }  # fmt: skip
    return {"runs": runs}


def test_welch_interval_matches_a_hand_computation():
    # diff -0.5, se sqrt(1/3 + 5/12) = 0.866, Welch dof 4.96 -> 4 (t 2.776): +-2.404, in % of 2.5
    lo, hi = welch_interval_pct([1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    assert lo == pytest.approx(100 * (-0.5 - 2.776 * 0.75**0.5) / 2.5, rel=1e-6)
    assert hi == pytest.approx(100 * (-0.5 + 2.776 * 0.75**0.5) / 2.5, rel=1e-6)
    assert welch_interval_pct([1.0], [1.0, 2.0]) is None


def test_a_noisier_variant_is_left_out_of_the_pooled_noise():
    data = _data({"adamw": [1.00, 1.01, 0.99], "a": [1.00, 1.01, 0.99], "wild": [1.0, 1.2, 0.8]})
    noise = pooled_noise(data, ["adamw", "a", "wild"])
    assert noise["excluded"] == ["wild"] and noise["runs"] == 6
    assert noise["std_pct"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize(
    "losses, verdict",
    [
        ([1.000, 1.001, 0.999], "yes"),  # interval well inside +0.3%
        ([1.050, 1.051, 1.049], "no (bound +0.3%)"),
        ([1.00, 1.03, 0.97], "not resolved (mean within +0.3%)"),
        ([1.02, 1.05, 0.99], "not resolved (mean above +0.3%)"),
    ],
)
def test_verdict_needs_the_whole_interval_on_one_side(losses, verdict):
    data = _data({"adamw": [1.0000, 1.0005, 0.9995], "x": losses})
    assert _verdict(variant_summary(data, "x"), 0.3) == verdict
