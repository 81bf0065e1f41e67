"""benchmarks.chaos at its smallest: one seed of a tiny schedule (a SIGKILL inside a synchronous save, a transient
NaN, one poisoned sample; 30 steps of 16 samples, a checkpoint every 10), its launches forked (the benchmark itself
runs each job under torchrun, too slow here)."""

from __future__ import annotations

import pytest

from benchmarks import chaos

pytestmark = pytest.mark.distributed  # the launches are 2-process DDP runs (gloo)


def test_a_tiny_schedule_survives_is_named_and_ends_bit_equal(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--seeds", "1", "--resize-seeds", "0", "--steps", "30", "--n", "160", "--poisoned", "1"]
    rows = chaos.main([*args, "--kinds", "kill_in_save,nan", "--launcher", "fork"])
    found = {row.kind: row for row in rows}
    assert sorted(found) == ["kill_in_save", "nan", "poisoned_sample"]
    assert all(row.survived and row.end == "bit-equal" for row in rows), rows
    kill, nan = found["kill_in_save"], found["nan"]
    assert (kill.named, kill.lost) == ("restart", 10)  # killed writing the save at 20: resumed at 10
    assert (nan.named, nan.lost) == ("replay", 0)  # replayed, applied bit-exact: nothing lost
    assert found["poisoned_sample"].named and found["poisoned_sample"].lost == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("kill_in_save "))
    assert row == ["kill_in_save", "1", "1/1", "1/1", "restart", "1/1", "-", "10.0", "10", "0.750", row[-1]]
    assert "goodput per seed (steps 30 / steps trained over all launches): mean 0.750" in out
    assert "every fault named in the incident log: yes" in out
