"""RouterHealthMonitor across 2 processes (torchrun, gloo, DDP): what each rank logs equals what one process logs
on the same global batches, the token counts summed over ranks (one launch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import torchrun
from tests.moe import router_ddp_run as run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return torchrun(Path(run.__file__), run.WORLD, tmp_path_factory.mktemp("router"), timeout=300)


@pytest.fixture(scope="module")
def one() -> dict[str, Any]:
    return run.fit(1)


def test_two_processes_log_what_one_process_logs_on_the_same_global_batch(
    ranks: list[dict[str, Any]], one: dict[str, Any]
) -> None:
    expected = {str(batch): metrics for batch, metrics in one["logged"].items()}
    assert sorted(expected) == ["1", "3"]
    for rank in ranks:
        assert sorted(rank["logged"]) == sorted(expected)
        for batch, metrics in expected.items():
            got = rank["logged"][batch]
            assert set(got) == set(metrics)
            for key, value in metrics.items():
                if "dead_experts" in key or "load_share" in key or "max_vio" in key:
                    assert got[key] == value, (batch, key)  # from token counts: exact
                else:
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (batch, key)


def test_the_open_window_holds_the_rank_s_own_tokens(ranks: list[dict[str, Any]], one: dict[str, Any]) -> None:
    """Step 5 is counted, not logged: each rank's window holds its own half of the global batch."""
    for name, layer in one["state"]["window"]["layers"].items():
        halves = [rank["state"]["window"]["layers"][name]["counts"] for rank in ranks]
        assert [a + b for a, b in zip(*halves, strict=True)] == layer["counts"]
        assert all(sum(h) == sum(layer["counts"]) // 2 for h in halves)


def test_with_every_action_on_every_rank_acts_as_one_process(tmp_path: Path) -> None:
    """The z-loss (a mean over each rank's tokens, averaged by DDP), the clip (the max over ranks) and the bias (the
    load over ranks): every rank's routers and bias equal one process's on the same global batches."""
    acting = torchrun(Path(run.__file__), run.WORLD, tmp_path, "actions", timeout=300)
    alone = run.fit(1, actions=True)
    assert any(any(b) for b in alone["bias"].values())  # the bias moved
    for rank in acting:
        assert rank["bias"] == alone["bias"]  # steps of +-u from the same counts: exact
        assert rank["routers"] == acting[0]["routers"]  # DDP: every rank alike
        for name, weight in alone["routers"].items():
            got, expected = torch.tensor(rank["routers"][name]), torch.tensor(weight)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (what JSON gave back)."""
    a, b = (torch.tensor(x, dtype=torch.float64) for x in (a, b))
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def test_a_fault_on_one_rank_is_decided_alike_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 alone routes with logits of +inf at one batch (its loss NaN, so every rank's averaged gradients): every
    rank skips that step, and its bias and routers stay as they were at that step (the clip scales nothing: the +inf
    max would zero the routers); every rank holds the same bias and routers after every batch, and logs the same
    figures."""
    got = torchrun(Path(run.__file__), run.WORLD, tmp_path, "fault", timeout=300)
    for rank in got:
        assert rank["skipped"] == 1
        assert rank["by_batch"][run.FAULT_AT] == rank["by_batch"][run.FAULT_AT - 1]  # the skipped step left both
        assert rank["by_batch"] == got[0]["by_batch"]
        assert all(torch.tensor(w).isfinite().all() for w in rank["routers"].values())
        assert sorted(rank["logged"]) == sorted(got[0]["logged"])
        for batch, metrics in got[0]["logged"].items():
            assert all(_same(rank["logged"][batch][k], v) for k, v in metrics.items()), batch
    assert any(any(b) for b in got[0]["bias"].values())  # the bias moved on the other steps
    window = got[0]["logged"][str(run.FAULT_AT + 1)]  # the window of the faulty batch: its +inf logits seen
    assert window["stability/router/logit_max_by_module/model.model.layers.0.mlp.gate"] == float("inf")
