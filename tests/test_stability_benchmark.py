"""benchmarks.stability's LR sweep: how the fastest reliable LR is chosen, and one small end-to-end run."""

from __future__ import annotations

import pytest

from benchmarks import stability
from benchmarks.stability_runs import Run
from benchmarks.stability_sweep import LRPoint, fastest_reliable, report


def runs(steps: list[int | None], diverged: int = 0) -> list[Run]:
    out = [Run(1.0, False, s, 0, 1.0, 1.0) for s in steps]
    for r in out[:diverged]:
        r.diverged, r.steps_to_target = True, None
    return out


def test_the_fastest_reliable_lr_skips_lrs_where_runs_break() -> None:
    points = [
        LRPoint(5e-3, runs([30, 32, 31, 29]), runs([34, 33, 35, 36])),
        LRPoint(1e-2, runs([26, 25, 27, 28]), runs([23, 22, 24, 25])),
        # bare is fastest here on the runs that survive, but one of four broke: not reliable at 98%
        LRPoint(2e-2, runs([None, 20, 21, 19], diverged=1), runs([21, 22, 23, 20])),
    ]
    bare, preset = fastest_reliable(points, False, 0.98), fastest_reliable(points, True, 0.98)
    assert bare is not None and bare.lr == 1e-2
    assert preset is not None and preset.lr == 2e-2
    assert fastest_reliable(points, False, 0.75).lr == 2e-2  # type: ignore[union-attr]
    lines, ratio = report(points, "test", 0.98)
    assert ratio == pytest.approx(21.5 / 26.5)
    assert any("preset / bare steps to target = 0.81" in line for line in lines)
    assert fastest_reliable([LRPoint(1e-2, runs([None], diverged=1), runs([None], diverged=1))], False, 0.98) is None


@pytest.mark.usefixtures("restore_process_settings")
def test_a_small_run_of_the_benchmark_with_its_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    diverged = stability.main(["--seeds", "1", "--configs", "postln", "--lm-steps", "12", "--sweep-lrs", "1e-3"])
    out = capsys.readouterr().out
    assert set(diverged) == {"postln"}
    assert "LR sweep, post-LN x6 (1 seeds per arm and LR" in out
    assert "\n0.001 " in out and "\n0.02 " in out  # the swept LR and the table's LR (reused)


def test_bad_sweep_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        stability.main(["--sweep-lrs", "1e-2,fast"])
    assert "--sweep-lrs must be numbers" in capsys.readouterr().err
