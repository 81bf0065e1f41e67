"""Two real processes (gloo): a spike that only one rank sees makes both ranks respond alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_stability import Outcome
from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("health_ddp_script.py")
SPIKE = 11


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("response", "fault"),
    [("skip", "loss"), ("skip", "after_allreduce"), ("rollback", "loss"), ("rollback", "lasting_loss")],
)
def test_a_spike_on_one_rank_is_answered_alike_on_both(tmp_path: Path, response: str, fault: str) -> None:
    """Under rollback, a lone spike is skipped and nothing rolls back; a lasting one (two steps) rolls back on both
    ranks at the step after it, which drops its update and skips the next 3."""
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, response, fault)
    assert rank0["outcomes"] == rank1["outcomes"]
    assert rank0["outcomes"][SPIKE] == int(Outcome.SKIPPED_SPIKE)
    assert rank0["final_weights"] == rank1["final_weights"]  # the replicas never drift apart
    if fault == "lasting_loss":
        assert rank0["rollbacks"] == rank1["rollbacks"] == 1
        assert rank0["outcomes"][SPIKE + 1] == int(Outcome.SKIPPED_SPIKE)
        assert rank0["outcomes"][SPIKE + 2 : SPIKE + 6] == [int(Outcome.SKIPPED_ROLLBACK)] * 4
    else:
        assert rank0["rollbacks"] == rank1["rollbacks"] == 0
        assert rank0["counts"] == rank1["counts"] == [19, 0, 0, 1, 0, 0]
