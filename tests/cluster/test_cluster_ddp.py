"""Two real processes (DDP, gloo), one launch shared by every test: rank 1 turns slow from global step 6 (a
sleep in its training step) and one bit of its weights flips after its 4th update (silent data corruption).
Logging every 2 optimizer steps, the weight hash checked every 3 (steps 3, 6, 9, 12; 3 and 9 are not logging
steps: their result rides the next logging step's transfer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("cluster_ddp_script.py")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return torchrun(SCRIPT, 2, tmp_path_factory.mktemp("cluster"))


def _rows(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Logged rows by optimizer step (Lightning's step label + 1)."""
    return {label + 1: metrics for label, metrics in result["rows"]}


def test_the_slow_rank_is_named_once_it_is_slow_and_not_before(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    warned = rank0["straggler_warnings"]
    assert rank1["straggler_warnings"] == []  # one warning per run, from rank 0
    # rank 1 sleeps from global step 6 (optimizer step 7): the windows ending at steps 8, 10, 12 are slow
    assert [w.split("up to optimizer step ")[1].split(" ")[0] for w in warned] == ["8", "10", "12"]
    assert all(w.startswith("Straggler: rank 1 took 0.4") for w in warned)
    rows = _rows(rank0)
    for step in (8, 10, 12):
        assert rows[step]["stability/slowest_rank"] == 1.0
        assert rows[step]["stability/rank_time_max"] >= 0.4 > 1.5 * rows[step]["stability/rank_time_median"]
    for step in (2, 4, 6):
        assert rows[step]["stability/rank_time_max"] < 0.4
    # the whole step is as slow on rank 0 as on rank 1 (it waits in the all-reduce): it cannot name anyone
    assert _rows(rank0)[12]["stability/step_time"] > 0.4 and _rows(rank1)[12]["stability/step_time"] > 0.4
    # the gathered figures are the same on every rank
    for step in (2, 8):
        assert {k: v for k, v in rows[step].items() if "rank" in k} == {
            k: v for k, v in _rows(rank1)[step].items() if "rank" in k
        }


def test_the_corrupted_replica_is_named_by_the_check_after_it_and_not_before(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    warned = rank0["hash_warnings"]
    assert rank1["hash_warnings"] == []
    # flipped after update 4: the check at step 3 passed, the checks at 6, 9 and 12 name rank 1
    assert [w.split("at optimizer step ")[1].split(" ")[0] for w in warned] == ["6", "9", "12"]
    assert all(
        "rank 1 (its replicas: ranks 0)" in w and "last check that found them equal was at step 3" in w for w in warned
    )
    rows = _rows(rank0)
    assert rows[4]["stability/replicas_differing"] == 0.0  # check 3, read at the logging step 4
    assert rows[6]["stability/replicas_differing"] == 1.0  # check 6 is a logging step: read at once
    assert rows[10]["stability/replicas_differing"] == 1.0  # check 9, read at step 10
    assert "stability/replicas_differing" not in rows[2] and "stability/replicas_differing" not in rows[8]
    assert rank0["final_weights"] != rank1["final_weights"]  # the fault itself is not hidden


def test_no_host_sync_of_the_package_off_logging_steps_check_steps_included(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        per_step = result["syncs_per_step"]
        assert len(per_step) == 12
        # optimizer steps 2, 4, ... log (one transfer); 3 and 9 are check steps that do not log: nothing
        assert per_step == [1 if step % 2 == 0 else 0 for step in range(1, 13)]


def test_which_ranks_must_hold_equal_weights(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        layouts = result["layouts"]
        assert layouts["ddp"] == [0, 0]
        assert layouts["replicated"] == [0, 0]  # DTensor, Replicate on a 1-D mesh of both ranks
        assert layouts["hybrid"] == [0, 0]  # a 2 x 1 ("replicate", "shard") mesh: both ranks hold shard 0
        assert "fully sharded" in layouts["fully_sharded"]
        assert "not DDP" in layouts["plain_not_ddp"]
        assert "2 different device meshes" in layouts["two_meshes"]
