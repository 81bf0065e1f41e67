"""2-process DDP (gloo): the critical batch equals a one-process computation on the same micro-batches, and the
ramp grows the batch alike on every rank, with its LR schedule counting samples."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_stability.schedules.specs import WarmupConstantCosineSchedule
from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("critical_batch_ddp_script.py")


@pytest.mark.distributed
def test_critical_batch_and_ramp_under_ddp(tmp_path: Path) -> None:
    ranks = torchrun(SCRIPT, 2, tmp_path)
    assert ranks[0] == ranks[1]  # every figure and decision alike on both ranks
    estimate = ranks[0]["estimate"]
    assert estimate["sizes"] == [3, 3, 3, 3]
    assert estimate["logged"] == pytest.approx(estimate["by_hand"], rel=1e-4)
    assert estimate["logged_stderr"] == pytest.approx(estimate["by_hand_stderr"], rel=1e-3)

    ramp = ranks[0]["ramp"]
    assert ramp["weights_equal"]
    grown = dict(ramp["grown"])
    assert grown and set(grown.values()) <= {4, 8}
    # the LR: base x schedule(samples, in steps of the starting batch) x sqrt(k); beta2 at a fixed half-life
    schedule, total = WarmupConstantCosineSchedule(warmup=0.1, decay=0.3), 80 // 2
    position, factor = 0, 2
    for step, (size, lr, beta2) in enumerate(zip(ramp["sizes"], ramp["lrs"], ramp["beta2s"], strict=True)):
        factor = grown.get(step, factor)
        assert size == factor or step == len(ramp["sizes"]) - 1  # the epoch's last window may be shorter
        assert lr == pytest.approx(0.05 * schedule(min(position, total), total) * math.sqrt(factor), rel=1e-6)
        assert beta2 == pytest.approx(0.999 ** (factor / 2), rel=1e-12)
        position += factor // 2
