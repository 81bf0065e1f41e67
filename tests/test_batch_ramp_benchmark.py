"""benchmarks.batch_ramp: the offline check's fit, and its --quick run end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import batch_ramp


@pytest.mark.parametrize("noise", [0.0, 10.0, 300.0])
def test_the_branch_fit_recovers_the_noise_scale_of_the_model(noise: float) -> None:
    batches = [16.0, 64.0, 256.0, 1024.0]
    gains = [5.0 / (b + noise) for b in batches]
    assert batch_ramp.noise_scale_from_branches(batches, gains) == pytest.approx(noise, abs=1e-6)


def test_the_branch_fit_says_nan_where_the_model_does_not_hold() -> None:
    assert math.isnan(batch_ramp.noise_scale_from_branches([16.0, 64.0], [0.0, -1.0]))  # nothing gained
    assert math.isnan(batch_ramp.noise_scale_from_branches([16.0, 64.0], [1.0, 2.0]))  # larger batch gains more


def test_unknown_family_is_refused() -> None:
    with pytest.raises(SystemExit):
        batch_ramp.main(["--families", "resnet"])


@pytest.mark.usefixtures("restore_process_settings")
def test_the_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = batch_ramp.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    (row,) = results["runs"].values()
    assert row["monitor_same_loss"]  # measuring changes no update
    assert row["ramp_steps"] < row["fixed_steps"] and 2 <= row["final_factor"] <= 16
    assert math.isfinite(row["ramp_loss"]) and math.isfinite(row["critical_batch"])
    check = results["checks"]["mlp"]
    assert len(check["gains"]) == 3 and math.isfinite(check["measured"])
    assert "claim (<= +0.5% loss with >= 30% fewer steps)" in out and "offline check" in out
