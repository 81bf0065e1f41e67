"""``lightning_stability.ranks`` across two real processes (gloo): every rank gets the same reduced values."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("ranks_script.py")


@pytest.mark.distributed
def test_every_helper_reduces_over_two_ranks(tmp_path: Path) -> None:
    results = torchrun(SCRIPT, 2, tmp_path)
    for me, r in enumerate(results):
        assert (r["distributed"], r["world"], r["rank"], r["group_world"]) == (True, 2, me, 2)
        assert r["any"] is True and r["all"] is False and r["all_true"] is True
        assert r["max"] == [1.0, 10.0] and r["min"] == [0.0, 9.0]
        assert r["mean"] == [1.5, 2.0] and r["mean_input_kept"]
        assert r["gather"] == [[0.0, 10.0], [1.0, 9.0]] and r["gather_0dim"] == [0.0, 1.0]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["host_reads"] == 0
