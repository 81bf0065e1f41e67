"""Two real processes (gloo): a non-finite gradient on one rank makes every rank skip the same step."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_stability import Outcome
from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("grad_norm_ddp_script.py")


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw"])
def test_inf_on_one_rank_skips_on_every_rank(tmp_path: Path, optimizer: str) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, optimizer)
    skipped = int(Outcome.SKIPPED_NONFINITE)
    for r in (rank0, rank1):
        assert r["outcomes"] == [0, 0, 0, skipped, 0, 0]
        assert r["bad_step_weights_unchanged"] and r["bad_step_state_unchanged"]
        assert r["other_steps_changed"]
        assert r["applied"] == 5
        assert r["norms"][3] in ("inf", "nan")
    # the same global norm on both ranks, and bit-identical weights at the end
    assert rank0["norms"] == rank1["norms"]
    assert rank0["final_weights"] == rank1["final_weights"]
    # the same decision everywhere, so one warning for the run (rank 0), not one per process
    assert (rank0["nonfinite_warnings"], rank1["nonfinite_warnings"]) == (1, 0)
