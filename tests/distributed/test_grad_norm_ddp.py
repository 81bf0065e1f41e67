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


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "precision"), [("adamw", "32-true"), ("adamw_fused", "32-true"), ("sgd", "16-mixed")]
)
def test_a_gradient_that_goes_bad_on_one_rank_after_the_all_reduce_is_skipped_everywhere(
    tmp_path: Path, optimizer: str, precision: str
) -> None:
    """Nothing spreads rank 1's inf to rank 0 here: only the flag's own all-reduce makes both ranks skip.

    Under fp16 the inf appears after the loss scaler looked: the skip is the monitor's (not an overflow), and
    the scale does not back off for it."""
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, optimizer, "after_allreduce", precision)
    skipped = int(Outcome.SKIPPED_NONFINITE)
    for r in (rank0, rank1):
        assert r["outcomes"] == [0, 0, 0, skipped, 0, 0]
        assert r["bad_step_weights_unchanged"] and r["bad_step_state_unchanged"]
        assert r["applied"] == 5
    assert rank0["final_weights"] == rank1["final_weights"]


@pytest.mark.distributed
def test_check_replicas_names_the_rank_whose_gradients_differ(tmp_path: Path) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, "adamw", "replica")
    assert len(rank0["replica_warnings"]) == 1 and rank1["replica_warnings"] == []  # warned once, on rank 0
    message = rank0["replica_warnings"][0]
    assert "rank 1:" in message and "rank 0:" not in message and "optimizer step 4" in message
    # the fault itself is not hidden: the replicas' weights have drifted apart
    assert rank0["final_weights"] != rank1["final_weights"]
