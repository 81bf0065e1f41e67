"""benchmarks.demo_load: a row end to end, and the busy processes gone after their block."""

from __future__ import annotations

import re

import pytest

from benchmarks import demo_load


@pytest.mark.distributed  # training in a subprocess
def test_a_row_times_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    demo_load.main(["--steps", "4", "--threads", "1", "--busy", "0"])
    out = capsys.readouterr().out
    assert re.search(r"^ +0 +1 +\d+\.\d +\d+s +\d+s +\d+\.\d+s$", out, re.M), out


def test_the_busy_processes_run_in_their_block_only() -> None:
    with demo_load.busy(2) as spinners:
        assert len(spinners) == 2 and all(s.poll() is None for s in spinners)
    assert all(s.poll() is not None for s in spinners)
