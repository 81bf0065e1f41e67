"""Two optimizers under DDP on two real processes: per-optimizer records agree across ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("gan_ddp_script.py")


@pytest.mark.distributed
def test_two_optimizers_under_ddp_and_fp16_skip_and_schedule_alike_on_every_rank(tmp_path: Path) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path)
    # 8 batches over 2 ranks: 4 steps per optimizer; the discriminator's NaN batch is skipped (by the scaler)
    assert rank0["counts"] == rank1["counts"] == [[3, 1, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]]
    assert rank0["lrs"] == rank1["lrs"]
    assert rank0["weights"] == rank1["weights"]
