"""PrecursorMonitor across processes (torchrun, 2 CPU processes, gloo): every early action at once (QK-clip,
StableAdamW update clipping, the LR back-off, a moment reset after a let-through spike) under DDP and under FSDP2
(StableFSDPStrategy), against one process on the same global batches.

* exact: the weights, the monitor's state and every logged ``stability/`` value equal the one-process run's
  (weights within ``WEIGHT_ATOL``: measured 2.4e-7 for both strategies, the summation order of the gradient
  reduction being the only difference; values within ``RTOL``; the action counts exactly);
* rank-consistent: every rank ends with the same state and weights, also when one rank's gradients alone are
  corrupted after the reduction (that rank's weights then differ, its actions do not);
* resumable: a fit resumed from a mid-run checkpoint ends bit for bit where the straight one does.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_stability import TrainingHealthMonitor
from tests.distributed import precursors_run as run
from tests.distributed.fsdp_common import full_weights
from tests.helpers import quiet_trainer, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = Path(run.__file__)
WEIGHT_ATOL = 2e-6
RTOL = 1e-5
COUNTS = ("clipped_heads", "moment_resets")


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    watched, record = run.monitor(), run.Record()
    health = TrainingHealthMonitor(response="warn", warmup_steps=5, report=False)
    model = run.module(batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(max_steps=run.STEPS, callbacks=[health, watched, record]).fit(model)
    weights = {k: v.flatten().tolist() for k, v in full_weights(model).items()}
    return {"state": watched.state_dict(), "metrics": record.metrics, "weights": weights}


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results: ``runs`` by name (straight, resumed, fault) and the sharded-scaling check."""
    out = tmp_path_factory.mktemp(request.param)
    results = torchrun(SCRIPT, run.WORLD, out, request.param, timeout=300)
    return [{**result, "runs": {r["name"]: r for r in result["runs"]}} for result in results]


def test_every_action_acts_in_the_reference_run(one_process: dict[str, Any]) -> None:
    """Else the comparisons below would compare actions that never ran."""
    state, last = one_process["state"], one_process["metrics"][-1]
    assert state["clipped_heads"] > 0 and state["moment_resets"] > 0
    assert state["backoff"] < 1 and last["stability/update_clip_min"] < 1


def test_weights_state_and_metrics_equal_one_process(ranks: list[dict[str, Any]], one_process: dict) -> None:
    straight = ranks[0]["runs"]["straight"]
    assert straight["spikes"] == [run.SPIKE]
    for name, expected in one_process["weights"].items():
        torch.testing.assert_close(
            torch.tensor(straight["weights"][name]), torch.tensor(expected), rtol=0, atol=WEIGHT_ATOL, msg=name
        )
    for key, expected in one_process["state"].items():
        if key in COUNTS:
            assert straight["state"][key] == expected, key
        elif key == "log_z":
            assert straight["state"][key]["ema"] == pytest.approx(expected["ema"], rel=RTOL)
        else:
            assert straight["state"][key] == pytest.approx(expected, rel=RTOL), key
    assert len(straight["metrics"]) == len(one_process["metrics"]) == run.STEPS
    for step, (got, expected) in enumerate(zip(straight["metrics"], one_process["metrics"], strict=True)):
        assert set(got) == set(expected), step
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=RTOL, abs=1e-6), (step, key)


def test_every_rank_ends_alike(ranks: list[dict[str, Any]]) -> None:
    for name in ("straight", "resumed"):
        first = ranks[0]["runs"][name]
        for other in ranks[1:]:
            assert other["runs"][name]["state"] == first["state"], name
            assert other["runs"][name]["weights"] == first["weights"], name


def test_a_fault_on_one_rank_after_the_reduction_moves_every_ranks_actions_alike(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 1's gradients x100 after the reduction, on that rank only: its update differs (under DDP its
    weights part from rank 0's), but the update clipping, the back-off, QK-clip and the moment reset decide alike
    on every rank (their inputs are reduced across ranks first)."""
    faulted = [rank["runs"]["fault"] for rank in ranks]
    assert faulted[0]["state"]["moment_resets"] > ranks[0]["runs"]["straight"]["state"]["moment_resets"]
    actions = ("stability/update_clip_min", "stability/lr_backoff", "stability/qk_clipped_heads")
    for other in faulted[1:]:
        assert other["state"] == faulted[0]["state"]
        for step, (mine, first) in enumerate(zip(other["metrics"], faulted[0]["metrics"], strict=True)):
            assert {k: mine.get(k) for k in actions} == {k: first.get(k) for k in actions}, step


def test_a_resumed_fit_ends_bit_for_bit_where_the_straight_one_does(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        straight, resumed = rank["runs"]["straight"], rank["runs"]["resumed"]
        assert resumed["state"] == straight["state"]
        assert resumed["weights"] == straight["weights"]
        assert resumed["metrics"][-1] == straight["metrics"][-1]


def test_qk_clip_scales_fsdp2_shards_as_it_scales_the_whole_tensor(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["sharded_scaling"] == {"rows across shards": True, "columns": True, "bias": True}
