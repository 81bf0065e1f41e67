"""Two real processes (gloo): SIGTERM reaches rank 1 only, and both ranks save at the same step and stop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_stability.checkpoint import verify_checkpoint
from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("signal_ddp_script.py")
SIGNAL_AT = 3


@pytest.mark.distributed
def test_a_signal_to_one_rank_saves_and_stops_on_both(tmp_path: Path) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, timeout=180)
    # the step under way ends (SIGNAL_AT + 1); rank 1's flag is in the exchange launched there and read one
    # boundary later, so both ranks save and stop at SIGNAL_AT + 2
    assert rank0["global_step"] == rank1["global_step"] == SIGNAL_AT + 2
    assert rank0["should_stop"] and rank1["should_stop"]
    assert rank0["files"] == rank1["files"] == [f"epoch=0-step={SIGNAL_AT + 2}.ckpt"]
    path = verify_checkpoint(tmp_path / "ckpts" / rank0["files"][0])
    assert torch.load(path, weights_only=False)["global_step"] == SIGNAL_AT + 2
