"""2-process DDP (gloo): gradients are all-reduced once per optimizer step, not once per micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("accumulation_ddp_script.py")


@pytest.mark.distributed
def test_one_all_reduce_round_per_optimizer_step(tmp_path: Path) -> None:
    ranks = torchrun(SCRIPT, 2, tmp_path)
    for result in ranks:
        every = result["every_batch"]
        assert every["steps"] == every["micro"] == 8
        buckets = every["rounds"] // every["micro"]  # bucket all-reduces of one synchronised backward
        assert buckets >= 1 and every["rounds"] == buckets * every["micro"]

        constant = result["constant_4"]
        assert constant["micro"] == 16 and constant["sizes"] == [4, 4, 4, 4]
        assert constant["rounds"] == buckets * constant["steps"]  # 4 rounds, not 16

        schedule = result["schedule"]
        assert schedule["sizes"] == [2, 2, 3, 3, 3, 3]
        assert schedule["rounds"] == buckets * schedule["steps"]  # 6 rounds, not 16
        assert every["weights_equal"] and constant["weights_equal"] and schedule["weights_equal"]
        # a clear error at setup on every rank, not torch's ValueError in the first forward
        assert (
            "`batchnorm='sync_batchnorm'` needs GPUs, but this run trains on 'cpu'" in result["sync_batchnorm_on_cpu"]
        )
    assert ranks[0] == ranks[1]
