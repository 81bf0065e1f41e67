"""Two real processes (gloo): a spike that only one rank sees makes both ranks respond alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_stability import Outcome
from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("health_ddp_script.py")
SPIKE = 11


@pytest.mark.distributed
@pytest.mark.parametrize(("response", "fault"), [("skip", "loss"), ("skip", "after_allreduce"), ("rollback", "loss")])
def test_a_spike_on_one_rank_is_answered_alike_on_both(tmp_path: Path, response: str, fault: str) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, response, fault)
    assert rank0["outcomes"] == rank1["outcomes"]
    assert rank0["outcomes"][SPIKE] == int(Outcome.SKIPPED_SPIKE)
    assert rank0["final_weights"] == rank1["final_weights"]  # the replicas never drift apart
    if response == "rollback":
        assert rank0["rollbacks"] == rank1["rollbacks"] == 1
        assert rank0["outcomes"][SPIKE + 1 : SPIKE + 4] == [int(Outcome.SKIPPED_ROLLBACK)] * 3
    else:
        assert rank0["counts"] == rank1["counts"] == [19, 0, 0, 1, 0]
