"""Loss parity: tolerance, first diverging step, and refusal to compare different problems."""

import json

import pytest

from llmadapt import TraceMismatchError
from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL, loss_parity, parity_of_runs


def test_agreeing_trajectories_pass():
    report = loss_parity([6.0, 5.5, 5.0], [6.0, 5.5 + 1e-6, 5.0])
    assert report.ok and report.first_divergence is None and report.max_abs_delta == pytest.approx(1e-6)


def test_first_diverging_step_is_named():
    """The report names the first step beyond atol + rtol*|loss|."""
    report = loss_parity([6.0, 5.5, 5.0, 4.0], [6.0, 5.5, 5.01, 4.5])
    assert not report.ok and report.first_divergence == 2
    assert report.describe(("a", "b")).startswith("parity failed at step 2: a loss 5.0, b loss 5.01")


def test_different_lengths_fail():
    assert not loss_parity([1.0, 1.0], [1.0]).ok


def test_the_default_tolerance_passes_fp32_noise_and_catches_a_real_difference():
    """Reduction-order noise (1e-6 relative) passes; a wrong normalisation or other data (1e-3 relative) fails."""
    losses = [6.2409, 6.1, 5.9, 5.7]
    assert loss_parity(losses, [x * (1 + 1e-6) for x in losses]).ok
    assert not loss_parity(losses, [x * (1 + 1e-3) for x in losses]).ok
    assert PARITY_RTOL * 6.0 + PARITY_ATOL < 6.0 * 1e-3  # the margin the comment above PARITY_RTOL promises


def test_runs_of_different_problems_are_not_compared(tmp_path):
    """Traces of different problems are refused unless told otherwise."""
    for name, problem in (("a", "p1"), ("b", "p2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"problem_hash": problem, "losses": [1.0]}))
    with pytest.raises(TraceMismatchError, match="ran different problems"):
        parity_of_runs(tmp_path / "a", tmp_path / "b")
    assert parity_of_runs(tmp_path / "a", tmp_path / "b", allow_mismatch=True).ok
