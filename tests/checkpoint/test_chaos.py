"""Faults mixed in one 2-process DDP run (gloo): real SIGKILLs and restarts with ``trainer.fit(ckpt_path="last")``,
``StepReplay`` with poisoned samples, ``StableCheckpoint(every_n_train_steps=10)``; the run must end bit-equal to
the uninterrupted one with the same poisoned samples (chaos.py, chaos_run.py: dropout, Lightning's shuffling
``DistributedSampler``, 10 steps an epoch here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.chaos import Fault, chaos

pytestmark = pytest.mark.distributed


def test_a_second_resume_at_an_epoch_end_trains_the_next_epoch_in_its_own_order(tmp_path: Path) -> None:
    """Killed before the update of step 14: resumed at 10, epoch 0's last step. Killed in the forward of step 21:
    resumed at 20, epoch 1's last step, from a checkpoint the first resumed launch wrote. That checkpoint must
    resume into epoch 2 (issue 46, problem 8: it resumed with epoch 1's sampler order again, in silence). A
    take-back at the epoch end (killed after publishing step 10, before listing it) resumes the same way."""
    result = chaos(tmp_path, [Fault("kill_before_update", 0, 14), Fault("kill_forward", 1, 21)], [3], steps=30, n=160)
    assert result.resumed_at == [0, 10, 20]
    assert result.quarantined, "the poisoned sample was never met: no StepReplay in the mix"
    assert not result.mismatches, result.line()
    assert result.max_abs_diff == 0.0
